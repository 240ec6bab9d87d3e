"""A forest: several requests' trees in one target pass (specexec/batching/). Each request's output is exactly
what it is alone: fp32 greedy ids equal its solo run for requests of different prompt lengths, with several
builders, resident and --offload ssd; the passes really are shared (the target's passes carry several requests,
and a streamed target reads each layer once per pass whatever the number of requests)."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from specexec.batching.pool import SeatPool
from specexec.config import EngineConfig, OffloadConfig, SamplingParams
from specexec.runtime.assembly import Runtime
from tests.tiny_models import prompt

GREEDY = SamplingParams()


def _ids(rt: Runtime, ids: list[int], n: int, sampling: SamplingParams = GREEDY) -> list[int]:
    return [t for step in rt.generate_ids(ids, n, sampling) for t in step]


def together(pool: SeatPool, prompts: list[list[int]], n: int,
             samplings: list[SamplingParams] | None = None) -> list[list[int]]:
    """Every prompt on its own seat, all started before any runs (so the first passes carry them all)."""
    samplings = samplings or [GREEDY] * len(prompts)
    out: list = [None] * len(prompts)
    runtimes = [pool.start(i) for i in range(len(prompts))]

    def work(i: int) -> None:
        try:
            out[i] = _ids(runtimes[i], prompts[i], n, samplings[i])
        except BaseException as e:        # noqa: BLE001 -- the test reports it
            out[i] = e
        finally:
            pool.end(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


PROMPTS = [prompt(1, 5), prompt(2, 17), prompt(3, 9)]


@pytest.mark.parametrize("builder", ["specexec", "chain", "dynamic"])
def test_greedy_forest_equals_each_request_alone(tiny_pair: tuple[Path, Path], tiny_perturbed_draft: Path,
                                                builder: str) -> None:
    config = EngineConfig(budget=8, dtype="float32", builder=builder, max_new_tokens=24)
    rt = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config)
    alone = [_ids(rt.variant(config), p, 24) for p in PROMPTS]
    pool = SeatPool(rt, len(PROMPTS))
    got = together(pool, PROMPTS, 24)
    assert got == alone
    sizes = pool.forest.stats.sizes
    assert sizes["target"][3] > 0 and sizes["draft"][3] > 0     # passes carried all three requests


def test_streamed_target_reads_each_layer_once_per_forest_pass(tiny_pair: tuple[Path, Path],
                                                              tiny_perturbed_draft: Path, tmp_path: Path) -> None:
    config = EngineConfig(budget=8, dtype="float32", max_new_tokens=16)
    rt = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config,
                      offload=OffloadConfig(offload="ssd", quant="none", cache_dir=str(tmp_path)))
    try:
        pager = rt.engine.target.pager
        assert pager.tier_of(0) != "resident"
        alone = []
        before = pager.collect(wait=True).totals()
        for p in PROMPTS:
            alone.append(_ids(rt.variant(config), p, 16))
        solo = pager.collect(wait=True).totals()
        pool = SeatPool(rt, len(PROMPTS))
        got = together(pool, PROMPTS, 16)
        after = pager.collect(wait=True).totals()
        assert got == alone
        per_pass = (solo["bytes_streamed"] - before["bytes_streamed"]) / (solo["passes"] - before["passes"])
        forest = pool.forest.stats
        assert after["passes"] - solo["passes"] == forest.passes["target"]
        assert (after["bytes_streamed"] - solo["bytes_streamed"]) / forest.passes["target"] == per_pass
        assert forest.calls["target"] > forest.passes["target"]       # several requests per streamed pass
    finally:
        rt.engine.close()


def test_seeded_sampling_in_a_forest_equals_each_request_alone(tiny_pair: tuple[Path, Path],
                                                               tiny_perturbed_draft: Path) -> None:
    config = EngineConfig(budget=8, dtype="float32", max_new_tokens=16)
    rt = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config)
    samplings = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in (5, 6, 7)]
    alone = [_ids(rt.variant(config), p, 16, s) for p, s in zip(PROMPTS, samplings)]
    assert alone[0] != _ids(rt.variant(config), PROMPTS[0], 16, SamplingParams(temperature=0.9, seed=8))
    assert together(SeatPool(rt, 3), PROMPTS, 16, samplings) == alone


def _calls(model, lengths: list[int], tree: int) -> list:
    """One call per prompt length: its own cache holding a prefilled prompt, then a tree of `tree` nodes (node i
    under node (i - 1) // 2: a binary tree) to verify after it."""
    from specexec.batching.forest_pass import Call
    from specexec.network.attention import TreeMask

    parent = [-1] + [(i - 1) // 2 for i in range(1, tree)]
    seen = torch.zeros(tree, tree, dtype=torch.bool)
    depth = [0] * tree
    for i in range(tree):
        j = i
        while j >= 0:
            seen[i, j] = True
            j = parent[j]
        depth[i] = 0 if i == 0 else depth[parent[i]] + 1
    calls = []
    for n, length in enumerate(lengths):
        cache = model.new_cache(length + tree + 8)
        ids = torch.tensor(prompt(20 + n, length))
        model(ids[None], torch.arange(length)[None], TreeMask(0), cache)
        cache.advance(length)
        tokens = torch.tensor(prompt(40 + n, tree))[None]
        calls.append(Call(tokens, (length + torch.tensor(depth))[None], TreeMask(length, seen), cache))
    return calls


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_a_forest_pass_gives_each_request_its_solo_rows(tiny_pair: tuple[Path, Path], tmp_path: Path,
                                                       quant: str) -> None:
    """Each request's hidden rows from one forest pass against its own forward: bit for bit on a row-exact
    target (int8 layers on the CPU kernels, streamed from the SSD tier), within fp32 rounding otherwise."""
    from specexec.batching.forest_pass import forest_forward

    rt = Runtime.load(str(tiny_pair[0]), None, EngineConfig(dtype="float32", max_new_tokens=8),
                      offload=OffloadConfig(offload="ssd", quant=quant, cache_dir=str(tmp_path)))
    model = rt.engine.target
    try:
        assert model.execution.row_exact == (quant == "int8")
        calls = _calls(model, [3, 11, 6], 7)
        with torch.inference_mode():
            solo = [model(c.tokens, c.positions, c.mask, c.cache) for c in calls]
            together = forest_forward(model, calls)
        for a, b in zip(together, solo):
            assert a.shape == b.shape
            assert torch.equal(a, b) if quant == "int8" else torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    finally:
        model.close()
