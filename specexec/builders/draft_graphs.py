"""CUDA graphs of the draft's forward: each (batch, tree width, key span) is captured once, then replayed.

A draft pass is launch-bound on a fast GPU (hundreds of small kernels for a few hundred tokens). The growth
core pads every batch to a few fixed sizes and gives every pass a tree mask of the same width K, so shapes
repeat from pass to pass and step to step, and each is captured once (torch.cuda.CUDAGraph) and replayed.

What is static: tokens, positions, slots [b], tree_mask [b, K] and the prefix length L0 live in fixed input
buffers, and attention runs over a fixed key span S >= L0 + K (L0 + K rounded up to SPAN tokens, at most the
cache's capacity): keys [0, L0) visible, [L0, L0 + K) as the tree mask says, the rest hidden. The mask is built
on the device from L0, so one graph serves every step until L0 + K crosses a span boundary. A shape is
captured the second time it is used (a shape seen once is not worth a capture), and the capture's warm-up run
is the real pass (it writes the real K/V), so nothing runs twice. Capturing synchronizes the device once
(torch.cuda.graph does); that happens a few times per SPAN tokens of context, never per pass.

The graph ends at the final norm (hidden [1, b, D]); the LM head runs eagerly after the replay (one large
kernel), so a graph holds no [b, V] logits buffer.

Exactness: a replay runs the kernels `span_forward` runs eagerly on the same inputs (bitwise equal); that
differs from the dense forward over keys [0, L0 + K) at most in summation order, since hidden keys add exact
zeros. The gpu tests check both, and greedy output against target-only decoding.

A draft with sliding-window layers is not captured (it runs eagerly with its TreeMask): the span mask is one
dense mask, which cannot carry a window per layer kind. Nor is a mixture-of-experts draft: which experts run
depends on the routing of each pass (a host sync per sparse layer), and a graph would replay the captured ones.

Switch: DraftState.cuda_graphs (None: on unless the environment sets SPECEXEC_CUDA_GRAPHS=0); a CPU never
captures. A capture that fails (a kernel that cannot be captured) turns graphs off for that cache, with one
warning, and the pass runs eagerly.

Does not know: trees, builders, sampling, how the model computes attention.
"""
from __future__ import annotations

import os
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from specexec.kv.cache import KVCache

SPAN = 512                       # key-span granularity: a graph is reused until L0 + K crosses a multiple
ENV = "SPECEXEC_CUDA_GRAPHS"
_RUNNERS: "weakref.WeakKeyDictionary[KVCache, DraftGraphs]" = weakref.WeakKeyDictionary()


def enabled(flag: bool | None, device: torch.device) -> bool:
    """Graphs run on CUDA only; flag None defers to SPECEXEC_CUDA_GRAPHS (default on)."""
    if device.type != "cuda":
        return False
    if flag is not None:
        return bool(flag)
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def runner(model: torch.nn.Module, cache: KVCache, flag: bool | None) -> "DraftGraphs | None":
    """The graph runner of this cache (kept across generate() calls), or None where graphs are off (and for a
    draft with sliding-window layers: the span mask is dense, and a dense mask carries no window)."""
    if not enabled(flag, cache.k.device) or not capturable(model):
        return None
    r = _RUNNERS.get(cache)
    if r is None or r.model is not model:
        r = _RUNNERS[cache] = DraftGraphs(model, cache)
    return None if r.failed else r


def capturable(model: torch.nn.Module) -> bool:
    """Whether the draft's forward can be one graph: no sliding-window layer, no routed (MoE) layer."""
    args = getattr(model, "args", None)
    return args is None or not (any(kind.window for kind in args.layer_kinds) or args.moe is not None)


def key_span(L0: int, K: int, capacity: int) -> int:
    """Keys a pass attends over: L0 + K rounded up to SPAN, at most the cache capacity."""
    return min(capacity, -(-(L0 + K) // SPAN) * SPAN)


def span_mask(tree_mask: Tensor, L0: Tensor, S: int) -> Tensor:
    """bool [b, S] over cache slots [0, S): the prefix [0, L0) visible, [L0, L0 + K) from tree_mask [b, K], the
    rest hidden. L0: long [1] on the device (no host value needed, so the mask can be captured)."""
    b, K = tree_mask.shape
    rel = torch.arange(S, device=tree_mask.device) - L0                      # [S]: slot - L0
    picked = tree_mask.gather(1, rel.clamp(0, K - 1)[None].expand(b, S))
    return (rel < 0)[None] | (picked & ((rel >= 0) & (rel < K))[None])


def span_hidden(model: torch.nn.Module, cache: KVCache, tokens: Tensor, positions: Tensor, tree_mask: Tensor,
                slots: Tensor, L0: Tensor, S: int) -> Tensor:
    """The draft's layers over the key span S (what a graph captures): hidden [1, b, D]."""
    return model(tokens[None], positions[None], span_mask(tree_mask, L0, S)[None, None], cache, slots)


def span_forward(model: torch.nn.Module, cache: KVCache, tokens: Tensor, positions: Tensor, tree_mask: Tensor,
                 slots: Tensor, L0: Tensor, S: int) -> Tensor:
    """The draft pass over the key span S: fp32 logits [b, V] (the LM head runs outside the graph: one large
    kernel, and a graph keeps only its small hidden output, not [b, V] logits)."""
    return model.logits(span_hidden(model, cache, tokens, positions, tree_mask, slots, L0, S))


@dataclass
class _Captured:
    """One graph and its static input and output buffers."""

    graph: "torch.cuda.CUDAGraph | None"
    tokens: Tensor
    positions: Tensor
    tree_mask: Tensor
    slots: Tensor
    L0: Tensor
    hidden: Tensor | None = None

    def load(self, tokens: Tensor, positions: Tensor, tree_mask: Tensor, slots: Tensor, L0: int) -> None:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.tree_mask.copy_(tree_mask)
        self.slots.copy_(slots)
        self.L0.fill_(L0)


class DraftGraphs:
    """Captured draft forwards of one model over one KV cache (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, cache: KVCache) -> None:
        self.model, self.cache = model, cache
        self.graphs: dict[tuple[int, int, int], _Captured] = {}
        self.seen: set[tuple[int, int, int]] = set()
        self.pool = None
        self.failed = False
        self.ptr = cache.k.data_ptr()

    def run(self, tokens: Tensor, positions: Tensor, tree_mask: Tensor, slots: Tensor) -> Tensor:
        """Same contract as DraftState.forward: fp32 logits [b, V] (a fresh tensor)."""
        if self.cache.k.data_ptr() != self.ptr:          # the cache was reallocated: old graphs point at it
            self.graphs.clear()
            self.seen.clear()
            self.ptr = self.cache.k.data_ptr()
        L0 = self.cache.length
        key = (tree_mask.shape[0], tree_mask.shape[1], key_span(L0, tree_mask.shape[1], self.cache.capacity))
        g = self.graphs.get(key)
        if g is not None:
            g.load(tokens, positions, tree_mask, slots, L0)
            g.graph.replay()
            return self.model.logits(g.hidden)
        L0_t = torch.full((1,), L0, dtype=torch.long, device=tokens.device)
        if key not in self.seen:
            self.seen.add(key)
            return span_forward(self.model, self.cache, tokens, positions, tree_mask, slots, L0_t, key[2])
        try:
            return self._capture(key, tokens, positions, tree_mask, slots, L0_t)
        except RuntimeError as e:
            self.failed = True
            self.graphs.clear()
            warnings.warn(f"CUDA graph capture of the draft failed, running it eagerly: {e}", stacklevel=2)
            return span_forward(self.model, self.cache, tokens, positions, tree_mask, slots, L0_t, key[2])

    def _capture(self, key: tuple[int, int, int], tokens: Tensor, positions: Tensor, tree_mask: Tensor,
                 slots: Tensor, L0: Tensor) -> Tensor:
        """Copy the inputs into static buffers, run the pass for real (the warm-up a capture needs), capture it."""
        S = key[2]
        st = _Captured(None, tokens.clone(), positions.clone(), tree_mask.clone(), slots.clone(), L0.clone())

        def body() -> Tensor:
            return span_hidden(self.model, self.cache, st.tokens, st.positions, st.tree_mask, st.slots, st.L0, S)
        out, st.graph, st.hidden = self._record(body, tokens.device)
        self.graphs = {k: v for k, v in self.graphs.items() if k[2] == S}     # spans below are outgrown
        self.graphs[key] = st
        return self.model.logits(out)

    def _record(self, body, device: torch.device) -> tuple[Tensor, "torch.cuda.CUDAGraph", Tensor]:
        """(the body's real output, a CUDA graph of it, the graph's static output): warm-up on a side stream,
        then capture into the runner's memory pool (shared by its graphs, replayed one at a time)."""
        with torch.cuda.device(device):
            here = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(here)
            with torch.cuda.stream(side):
                out = body()
            here.wait_stream(side)
            out.record_stream(here)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                static_out = body()
        if self.pool is None:
            self.pool = graph.pool()
        return out, graph, static_out
