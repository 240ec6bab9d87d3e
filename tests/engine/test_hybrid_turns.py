"""Conversation turns on a hybrid target (tiny Qwen3.5, a hybrid draft): the next turn keeps the attention KV and
the linear layers' states it can (KVCache.reusable: everything, a point inside the latest commit, the snapshot at
the end of the last prompt, or nothing), and every turn's ids equal a fresh run's on the same prompt."""
from __future__ import annotations

from pathlib import Path

import pytest

from specexec.config import EngineConfig, OffloadConfig
from specexec.runtime.assembly import Runtime
from tests.tiny_models import DRAFT_PERTURB, write_tiny_model

N_NEW = 12


@pytest.fixture(scope="module")
def runtime(tiny_qwen3_5: Path, tmp_path_factory: pytest.TempPathFactory) -> Runtime:
    draft = write_tiny_model(tiny_qwen3_5.parent / f"{tiny_qwen3_5.name}-draft", perturb=DRAFT_PERTURB,
                             base=tiny_qwen3_5, seed=30)
    return Runtime.load(str(tiny_qwen3_5), str(draft), EngineConfig(budget=8, max_new_tokens=N_NEW),
                        offload=OffloadConfig(offload="none", quant="none",
                                              cache_dir=str(tmp_path_factory.mktemp("turns-cache"))))


def turn(rt: Runtime, ids: list[int]) -> tuple[list[int], int]:
    out = [t for step in rt.generate_ids(ids, N_NEW) for t in step]
    return out, rt.engine.stats.reused_tokens


def fresh(rt: Runtime, ids: list[int]) -> list[int]:
    rt.engine.reset()
    return turn(rt, ids)[0]


def two_turns(rt: Runtime, lag: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """A first turn from nothing and a second that reuses all of it but `lag` tokens: (p1, a1, p2, a2)."""
    p1 = rt.encode("The quick brown fox")
    rt.engine.reset()
    a1, reused = turn(rt, p1)
    assert reused == 0
    p2 = p1 + a1 + rt.encode("jumps over")[1:]
    a2, reused = turn(rt, p2)
    assert reused >= len(p1) + len(a1) - lag
    return p1, a1, p2, a2


def test_turns_reuse_what_a_state_can_and_stay_exact(runtime: Runtime) -> None:
    rt = runtime
    p1, _, p2, a2 = two_turns(rt, 1)                              # the whole first turn
    retry, reused = turn(rt, p2)                                  # the same prompt again: the snapshot
    assert reused == len(p2) - 1 and retry == a2
    edited = p1[:3] + rt.encode("lazy dog")[1:]
    a3, reused = turn(rt, edited)                                 # an early edit: nothing of the state fits
    assert reused == 0
    assert a2 == fresh(rt, p2) and a3 == fresh(rt, edited)


@pytest.fixture(scope="module")
def mtp_runtime(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Runtime:
    """A tiny Qwen3-Next drafting with its own MTP layer (what chat picks for a checkpoint that has one)."""
    from tests.drafters.drafter_writer import write_qwen_mtp
    from tests.tiny_models import hybrid_model
    target = write_qwen_mtp(hybrid_model(tiny_root, "qwen3_next"), tmp_path_factory.mktemp("turns-mtp") / "next")
    return Runtime.load(str(target), "mtp", EngineConfig(budget=8, max_new_tokens=N_NEW),
                        offload=OffloadConfig(offload="none", quant="none",
                                              cache_dir=str(tmp_path_factory.mktemp("turns-mtp-cache"))))


def test_turns_with_a_drafter_reuse_the_state_and_stay_exact(mtp_runtime: Runtime) -> None:
    """A drafter's rows lag the target's by one, so a turn keeps at most all but its last prompt token; the next
    turn still reuses the whole first one (a point inside the latest commit), and a turn that leaves the last
    answer early returns to the snapshot at the end of the last prompt."""
    rt = mtp_runtime
    _, _, p2, a2 = two_turns(rt, 2)
    p3 = p2 + a2[:1] + rt.encode("lazy dog")[1:]                # leaves the answer after its first token
    a3, reused = turn(rt, p3)
    assert reused == len(p2) - 1
    assert a2 == fresh(rt, p2) and a3 == fresh(rt, p3)
