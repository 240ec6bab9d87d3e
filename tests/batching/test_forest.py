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
