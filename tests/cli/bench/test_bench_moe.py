"""`specexec bench moe --synthetic`: expert-aware trees against node-count budgets at equal pass time."""
from __future__ import annotations

import json

import pytest

from cli.bench.common import Result
from cli.bench.components.moe import equal_time
from cli.main import main


def test_expert_aware_trees_beat_the_node_budget_of_the_same_pass_time(capsys: pytest.CaptureFixture[str]) -> None:
    """A seeded world (gpt-oss-120b's plan): the expert-aware tree's tokens/s exceeds what the node-count
    budgets reach at its realised pass time; its predicted pass time follows the realised one."""
    code = main(["bench", "moe", "--synthetic", "gpt-oss-120b", "--budgets", "16", "--node-budgets", "1,2,4",
                 "--steps", "60", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["rows_kind"] for r in out["rows"]] == ["alone"] + ["nodes"] * 3 + ["experts"]
    nodes = [r for r in out["rows"] if r["rows_kind"] == "nodes"]
    assert [r["s_per_pass"] for r in nodes] == sorted(r["s_per_pass"] for r in nodes)    # more nodes, more experts
    (same,) = out["equal_time"]
    assert same["node_budget_tok_s"] is not None and same["ratio"] > 1.05
    expert, alone = out["rows"][-1], out["rows"][0]
    assert alone["tokens_per_pass"] == 1.0 and alone["s_per_pass"] < nodes[0]["s_per_pass"]   # one row: fewest experts
    assert expert["tok_s"] > 1.1 * alone["tok_s"]          # speculation on the streamed MoE pays (it hurts elsewhere)
    assert abs(expert["predicted_s_per_pass"] - expert["s_per_pass"]) < 0.25 * expert["s_per_pass"]


def test_equal_time_interpolates_between_the_node_rows_around_it() -> None:
    rows = [{"rows_kind": "nodes", "budget": 1, "s_per_pass": 0.1, "tok_s": 10.0},
            {"rows_kind": "nodes", "budget": 4, "s_per_pass": 0.3, "tok_s": 8.0},
            {"rows_kind": "experts", "budget": 16, "s_per_pass": 0.2, "tok_s": 12.0},
            {"rows_kind": "experts", "budget": 64, "s_per_pass": 0.5, "tok_s": 7.0}]
    inside, outside = equal_time(rows)
    assert inside["node_budget_tok_s"] == 9.0 and inside["ratio"] == round(12 / 9, 3)
    assert outside["node_budget_tok_s"] is None and outside["ratio"] is None


def test_bench_rows_weigh_each_prompts_moe_stats_by_its_passes() -> None:
    r = Result("specexec", moe_runs=[
        {"distinct_experts_per_layer": 4.0, "expert_bytes_per_pass": 100.0, "expert_bytes_all": 1000,
         "expert_cache_hit_rate": None, "passes": 1},
        {"distinct_experts_per_layer": 8.0, "expert_bytes_per_pass": 400.0, "expert_bytes_all": 1000,
         "expert_cache_hit_rate": 0.5, "passes": 3}, None])
    assert r.moe() == {"distinct_experts_per_layer": 7.0, "expert_bytes_per_pass": 325.0, "expert_bytes_all": 1000,
                       "expert_cache_hit_rate": 0.5, "passes": 4}
    assert Result("no-draft").moe() is None
