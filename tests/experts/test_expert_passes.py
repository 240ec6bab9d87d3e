"""specexec/companions/experts.py through the engine: an MoE target's routing learned, trees trimmed to the experts'
worth (still exact), and stats.moe counted in the profiler's ledger."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specexec.config import EngineConfig, SamplingParams
from specexec.companions.experts import ExpertPasses
from specexec.runtime.assembly import Runtime
from tests.tiny_models import DRAFT_PERTURB, write_tiny_model

N_NEW = 20


@pytest.fixture(scope="module")
def pair(tiny_qwen3_moe: Path, tiny_root: Path) -> tuple[Path, Path]:
    draft = write_tiny_model(tiny_root / "qwen3-moe-trim-draft", perturb=DRAFT_PERTURB, base=tiny_qwen3_moe,
                             seed=31)
    return tiny_qwen3_moe, draft


def synthetic(rt: Runtime, mode: str, expert_s: float = 0.02) -> ExpertPasses:
    """A streamed target's costs on the resident tiny one: nothing held, expert_s seconds per expert."""
    args = rt.engine.target.args
    L = sum(args.moe.sparse(i) for i in range(args.n_layers))
    ep = ExpertPasses(args, torch.full((L,), expert_s), 4096, base=lambda rows: 0.01, mode=mode,
                      held=torch.zeros(L, args.moe.n_experts, dtype=torch.bool))
    rt.engine.experts = ep
    ep.attach(rt.engine.target)
    return ep


def generate(rt: Runtime, sampling: SamplingParams = SamplingParams()) -> list[int]:
    ids = rt.encode("The quick brown fox")
    return [t for step in rt.engine.generate(ids, N_NEW, sampling) for t in step]


def test_trimmed_trees_decode_exactly_and_are_smaller(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    alone = Runtime.load(str(target), None, EngineConfig(max_new_tokens=N_NEW))
    want = generate(alone)
    rt = Runtime.load(str(target), str(draft), EngineConfig(budget=32, max_new_tokens=N_NEW))
    full = generate(rt)
    ep = synthetic(rt, "experts")
    trimmed = generate(rt)
    assert full == want and trimmed == want
    rows = [r["rows"] for r in ep.records]
    assert len(rows) == rt.stats()["steps"] and min(rows) < 33                      # something was trimmed
    assert ep.routing.passes == len(rows) and 0 < ep.routing.gamma <= 1


def test_stats_moe_counts_every_pass(pair: tuple[Path, Path]) -> None:
    target, draft = pair
    rt = Runtime.load(str(target), str(draft), EngineConfig(budget=16, max_new_tokens=N_NEW))
    generate(rt)
    moe = rt.stats()["moe"]
    args = rt.engine.target.args
    assert moe["passes"] == rt.stats()["steps"]
    assert args.moe.top_k <= moe["distinct_experts_per_layer"] <= args.moe.n_experts
    assert moe["expert_bytes_per_pass"] == 0 and moe["expert_cache_hit_rate"] is None      # resident: nothing read
    assert rt.engine.profiler.summary()["moe"] == moe                                       # one ledger


def test_trees_verified_by_rrs_wor_are_never_trimmed(pair: tuple[Path, Path]) -> None:
    """A sampled-without-replacement tree (rsd) needs every drafted child for recursive rejection sampling."""
    target, draft = pair
    rt = Runtime.load(str(target), str(draft), EngineConfig(budget=16, max_new_tokens=8, builder="rsd"))
    ep = synthetic(rt, "experts", expert_s=10.0)
    generate(rt, SamplingParams(temperature=0.8, seed=3))
    assert not rt.engine._trims and all(r["predicted_expert_s"] is None for r in ep.records)


def test_a_bad_trim_mode_is_one_line() -> None:
    from specexec.options import ConfigError

    with pytest.raises(ConfigError, match="--expert-trim"):
        EngineConfig(expert_trim="some")

