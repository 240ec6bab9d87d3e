"""`specexec bench builders` and `specexec bench accept` on the tiny pair: every builder's row, exactness at
T = 0 against the target alone, the JSON contract, one-line errors; the measured acceptance vector is cached
where `--builder static` finds it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main
from specexec.tuning import acceptance
from specexec.builders.registry import names as builder_names
from specexec.config import EngineConfig
from specexec.runtime.assembly import Runtime

ROW_KEYS = {"builder", "budget", "temperature", "rule", "tokens_per_pass", "draft_ms_per_step",
            "target_ms_per_step", "tok_s", "speedup", "identical", "first_mismatch"}


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_builder_at_both_temperatures(capsys, tiny_pair, tiny_perturbed_draft, cache_dir) -> None:
    code, out, err = _run(capsys, "bench", "builders", "--model", str(tiny_pair[0]), "--draft",
                          str(tiny_perturbed_draft), "--dtype", "float32", "--limit", "2", "--max-new-tokens", "10",
                          "--warmup", "0", "--budgets", "4,12", "--temperatures", "0,0.6", "--seed", "3", "--json")
    assert code == 0, err
    data = json.loads(out)
    rows = data["rows"]
    assert len(rows) == 2 * (1 + 2 * len(builder_names()))               # per T: target only + builders × budgets
    assert all(ROW_KEYS <= r.keys() for r in rows)
    greedy = [r for r in rows if r["temperature"] == 0 and r["budget"] is not None]
    assert {r["builder"] for r in greedy} == set(builder_names())
    assert all(r["identical"] is True for r in greedy), [r for r in greedy if not r["identical"]]
    assert all(r["tokens_per_pass"] >= 1 for r in rows if r["tokens_per_pass"] is not None)
    drafted = [r for r in greedy if r["builder"] not in ("recycling",)]
    assert any(r["tokens_per_pass"] > 1.2 for r in drafted)       # the perturbed draft does get accepted
    sampled = {r["builder"]: r["rule"] for r in rows if r["temperature"] == 0.6 and r["budget"] == 4}
    assert sampled["rsd"] == "rrs_wor" and sampled["specexec"] == "sample_match"
    assert {(w["temperature"], w["budget"]) for w in data["best"]} == {(0, 4), (0, 12), (0.6, 4), (0.6, 12)}
    assert "bench builders" in err and "most tokens/pass" in err


def test_without_a_draft_only_draft_free_builders_run(capsys, tiny_pair, cache_dir) -> None:
    code, out, err = _run(capsys, "bench", "builders", "--model", str(tiny_pair[0]), "--no-draft", "--dtype",
                          "float32", "--limit", "1", "--max-new-tokens", "6", "--warmup", "0", "--budgets", "8",
                          "--temperatures", "0", "--json")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [r["builder"] for r in rows] == ["target only", "recycling"] and rows[1]["identical"] is True


@pytest.mark.parametrize("extra, message", [
    (["--builders", "nope"], "unknown --builders 'nope'"),
    (["--budgets", "8,x"], "--budgets"),
    (["--temperatures", "hot"], "--temperatures"),
    (["--temperatures", "-1"], "temperature"),
])
def test_builders_bench_user_errors(capsys, tiny_pair, tiny_perturbed_draft, extra, message) -> None:
    code, out, err = _run(capsys, "bench", "builders", "--model", str(tiny_pair[0]), "--draft",
                          str(tiny_perturbed_draft), *extra)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error:") and message in err


def test_builders_needing_a_draft_are_refused_without_one(capsys, tiny_pair) -> None:
    code, _, err = _run(capsys, "bench", "builders", "--model", str(tiny_pair[0]), "--no-draft", "--builders",
                        "dynamic")
    assert code == 2 and "need a draft model" in err


def test_bench_accept_caches_the_vector_static_then_uses(capsys, tiny_pair, tiny_perturbed_draft, cache_dir) -> None:
    code, out, err = _run(capsys, "bench", "accept", "--model", str(tiny_pair[0]), "--draft",
                          str(tiny_perturbed_draft), "--dtype", "float32", "--limit", "2", "--max-new-tokens", "12",
                          "--temperatures", "0,0.6", "--positions", "6", "--draws", "2", "--json")
    assert code == 0, err
    data = json.loads(out)
    path = Path(data["path"])
    assert path.is_file() and path.parent == cache_dir / "acceptance"
    by_t = {r["temperature"]: r for r in data["rows"]}
    for r in by_t.values():
        assert len(r["acceptance"]) == 6 and 0 < sum(r["acceptance"]) <= 1 + 1e-6 and r["positions"] > 0
        assert r["acceptance"][0] == max(r["acceptance"])         # a related draft: its first choice is best
        assert r["expected_tokens_per_pass"]["64"] >= r["expected_tokens_per_pass"]["16"] >= 1
    rt = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), EngineConfig(builder="static", budget=8))
    assert rt.engine.builder.vector_for(0.0) == tuple(by_t[0.0]["acceptance"])
    assert rt.engine.builder.vector_for(0.9) == tuple(by_t[0.6]["acceptance"])
    other = rt.variant(EngineConfig(builder="specexec", budget=8))
    assert other.builder_name == "specexec"                       # only static takes the option


def test_bench_accept_needs_a_pair(capsys, tiny_pair) -> None:
    code, _, err = _run(capsys, "bench", "accept", "--model", str(tiny_pair[0]), "--no-draft")
    assert code == 2 and "--draft" in err and err.count("\n") == 1


def test_static_without_a_measured_vector_keeps_its_default(tiny_pair, tiny_perturbed_draft, cache_dir) -> None:
    from specexec.builders.static import DEFAULT_ACCEPTANCE

    rt = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), EngineConfig(builder="static", budget=8))
    assert rt.engine.builder.vector_for(0.6) == DEFAULT_ACCEPTANCE
    assert not acceptance.default_path(rt.pair).exists()
