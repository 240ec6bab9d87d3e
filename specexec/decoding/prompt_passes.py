"""The passes a generation runs before its first step: the prompt's prefill in chunks (how many tokens a pass of
a model takes, progress as it goes), the prefix a later call keeps of the previous one's context, and --budget
auto's calibration passes (target passes over flat trees of a few sizes, timed on the host).

Does not know: trees beyond the flat calibration ones, acceptance, builders, which model is the target or the
draft (callers pass the model, its cache and what to call the pass), where calibrated costs are kept.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specexec.abilities import has
from specexec.builders.base import RowListener
from specexec.config import PREFILL_CHUNK
from specexec.generation import PrefillProgress
from specexec.kv.cache import KVCache
from specexec.network.model import PlansPrefill, Transformer, TreeMask
from specexec.tree import TokenTree
from specexec.tuning.budget import calibration_sizes
from specexec.uploads import upload


def chunk_size(model: Transformer, configured: int | None) -> int:
    """Prompt tokens per prefill pass of `model`: a streamed target's planned `prefill_tokens` (one pass streams
    the whole model, so as many as its memory plan allows), else PREFILL_CHUNK; `configured`
    (EngineConfig.prefill_chunk) replaces the default and caps the planned figure."""
    planned = model.prefill_tokens if has(model, PlansPrefill) else None
    if planned is None:
        return configured or PREFILL_CHUNK
    return min(planned, configured) if configured else planned


def prefill(model: Transformer, cache: KVCache, ids: list[int], chunk: int, device: torch.device,
            which: str = "target", states: torch.Tensor | None = None, on_rows: RowListener | None = None,
            on_progress: Callable[[PrefillProgress], None] | None = None) -> None:
    """Run ids through `model` in passes of `chunk` tokens and commit them to `cache`; after each pass
    on_rows(start, hidden [T, D]) hears its rows' output (ids[start:start + T]) and on_progress how far it got
    (host time: it never waits for the device). states [len(ids), D]: a drafter's state before each token."""
    progress = PrefillProgress(which, len(ids), -(-len(ids) // chunk), time.perf_counter())
    for start in range(0, len(ids), chunk):
        part = upload(ids[start:start + chunk], device)
        T, L = part.numel(), cache.length
        pos = torch.arange(L, L + T, device=device)
        fed = () if states is None else (None, states[start:start + T][None])
        hidden = model(part[None], pos[None], TreeMask(L), cache, *fed)   # the prefix, then causal over it
        cache.advance(T)
        if on_rows is not None:
            on_rows(start, hidden[0])
        if on_progress is not None:
            progress.done, progress.passes_done = progress.done + T, progress.passes_done + 1
            on_progress(progress)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def calibration(verify: Callable[[TokenTree], object], root: int, max_budget: int,
                device: torch.device) -> list[tuple[int, float]]:
    """(rows, seconds) of one `verify` pass over a flat tree of `root` and n children for each of
    calibration_sizes(max_budget) (the smallest timed twice: the first pass also warms up)."""
    out = []
    for n in calibration_sizes(max_budget):
        tree = TokenTree.from_lists([root] * (n + 1), [-1] + [0] * n, device=device)
        seconds = []
        for _ in range(2 if n == 1 else 1):
            t0 = time.perf_counter()
            verify(tree)
            seconds.append(time.perf_counter() - t0)
        out.append((n + 1, seconds[-1]))
    return out
