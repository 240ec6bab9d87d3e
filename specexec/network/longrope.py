"""LongRoPE's switch from its short to its long factors (Phi-3), on the engine's side: at the length where
transformers switches, and the same for a tree pass as for target-only decoding.

transformers computes the logits after a sequence of L tokens with the short factors while L <= the original
context (ModelArgs' original_max_position_embeddings: `specexec.network.rope.long_switch`), and with the long ones
beyond it; its generate() re-runs the whole context the first time a generation grows past that length (the
cached rows were computed with the short factors). The engine does the same with three rules, all keyed on
the KV cache's `long_rope` flag (which factors its rows were computed with; the model reads it):
- begin: a generation whose prompt is longer than the switch runs long from the start; rows a cache keeps
  from an earlier turn under the other factors are dropped (`begin`);
- cap: while short, no tree node may sit at a position whose next-token logits would need the long factors,
  so the tree budget is capped at switch - 1 - committed (0: a root-only step) (`budget_cap`);
- switch: once the root itself is past the switch, the committed context is run again with the long factors
  before the step (`must_switch`; the engine's prefill does it).
A model without LongRoPE is never touched: every function is a no-op for it.

Does not know: trees, builders, how the engine prefills.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from specexec.kv.cache import KVCache
from specexec.network.rope import long_switch


def switch_of(model: nn.Module) -> int | None:
    """The model's LongRoPE switch length (None: its RoPE does not depend on the length)."""
    args = getattr(model, "args", None)
    return long_switch(args) if args is not None else None


def begin(model: nn.Module, cache: KVCache, prompt_len: int) -> None:
    """Before a generation's prefill over a prompt of `prompt_len` tokens: the cache's factors are the
    prompt's (long when it is longer than the switch); rows kept under the other factors are dropped."""
    switch = switch_of(model)
    if switch is None:
        return
    long = prompt_len > switch
    if cache.long_rope != long:
        cache.truncate(0)
        cache.long_rope = long


def budget_cap(model: nn.Module, cache: KVCache) -> int | None:
    """The most tree nodes this step may draft under the short factors (None: no cap)."""
    switch = switch_of(model)
    if switch is None or cache.long_rope:
        return None
    return max(0, switch - 1 - cache.length)


def rerun_past_switch(runs: Sequence[tuple[nn.Module, KVCache, str]], context: list[int],
                      prefill: Callable[[nn.Module, KVCache, list[int], str], None]) -> None:
    """For each (model, cache, which) whose root is past the switch under the short factors (must_switch):
    drop the cache's rows, mark it long and prefill(model, cache, context[:length], which) again."""
    for model, cache, which in runs:
        if must_switch(model, cache):
            n, cache.long_rope = cache.length, True
            cache.truncate(0)
            prefill(model, cache, context[:n], which)


def must_switch(model: nn.Module, cache: KVCache) -> bool:
    """Whether the root (position cache.length) is past the switch while the rows are short: the context
    must be run again with the long factors."""
    switch = switch_of(model)
    return switch is not None and not cache.long_rope and cache.length + 1 > switch
