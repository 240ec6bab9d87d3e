"""CUDA graphs of the draft's forward: each (batch, tree width, key span) is captured once, then replayed.

A draft pass is launch-bound on a fast GPU (hundreds of small kernels for a few hundred tokens). The growth
core pads every batch to a few fixed sizes and gives every pass a tree mask of the same width K, so shapes
repeat from pass to pass and step to step, and each is captured once (torch.cuda.CUDAGraph) and replayed.

What is static: the embedded tokens (hidden [1, b, D]), positions, slots [b], tree_mask [b, K] and the prefix
length L0 live in fixed input buffers, and attention runs over a fixed key span S >= L0 + K (`key_span`: L0 + K
rounded up to a step of SPAN tokens that grows to a quarter of the context, so hidden keys stay under a
quarter of the visible ones and a long chat recaptures about four times per doubling of its context, at most
the cache's capacity): keys [0, L0) visible, [L0, L0 + K) as the tree mask says, the rest hidden. The mask is
built on the device from L0, so one graph serves every step until L0 + K crosses a span boundary. A shape is
captured the second time it is used (a shape seen once is not worth a capture), and the capture's warm-up run
is the real pass (it writes the real K/V), so nothing runs twice.

The token embedding runs eagerly before the replay, outside the graph: a self-draft's embedding may live in host
RAM (HostEmbedding copies the ids to the host), which no graph can hold. The LM head runs eagerly after the
replay (one large kernel), so a graph holds no [b, V] logits buffer: a graph is the draft's layers and its
final norm, hidden [1, b, D] in, hidden [1, b, D] out.

How it captures: on a side stream that waits for the compute stream (no device-wide synchronize, no garbage
collection, no emptying of the allocator: those are what torch.cuda.graph does on entry, and here a capture
happens mid-step), in THREAD-LOCAL capture mode: the pager's loader threads keep copying, recording and waiting
on events while the draft captures (a global-mode capture would make their calls illegal, refuse the capture
and break the next streamed pass). Every graph of a runner allocates from ONE memory pool, taken once and kept
across spans (graphs are replayed one at a time, so they share it), and every capture runs on the runner's ONE
side stream: a stream gets its own cuBLAS workspace (32 MiB on sm90) and its own cached blocks, which nothing
frees, so a stream per capture would pin up to one workspace per shape. The ledger counts both (planning/needs.py,
line "draft graphs": one workspace and the pool, about one draft pass's activations).

Exactness: a replay runs the kernels `span_forward` runs eagerly on the same inputs (bitwise equal); that
differs from the dense forward over keys [0, L0 + K) at most in summation order, since hidden keys add exact
zeros. The gpu tests check both, and greedy output against target-only decoding.

Lifetime: the runners live in a table weakly keyed by the draft's KV cache, and a runner holds its cache only
weakly: when the engine drops a cache (a /budget change, a bench row, a calibration run), its graphs and their
pool go with it.

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
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from specexec.kv.cache import KVCache
from specexec.network.model import one_graph

SPAN = 2048                      # the smallest key-span step: a graph is reused until L0 + K crosses a step
ENV = "SPECEXEC_CUDA_GRAPHS"
CAPTURE_MODE = "thread_local"    # other threads (the pager's loaders) may make any CUDA call while we capture
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
    """Whether the draft's forward can be one graph: no sliding-window layer, no routed (MoE) layer, no layer
    whose mixer reads the tree itself (a recurrent state: its scratch is found by slot, and a dense mask is not a
    tree); nor a model that says it `captures` nothing (a forest's seat: batching/seats.py)."""
    if getattr(model, "captures", True) is False:
        return False
    args = getattr(model, "args", None)
    return args is None or one_graph(args)


def key_span(L0: int, K: int, capacity: int) -> int:
    """Keys a pass attends over: L0 + K rounded up to a step of SPAN tokens, or of a quarter of the largest
    power of two <= L0 + K when that is larger; at most the cache capacity."""
    n = L0 + K
    step = max(SPAN, (1 << max(n.bit_length() - 1, 0)) // 4)
    return min(capacity, -(-n // step) * step)


def span_mask(tree_mask: Tensor, L0: Tensor, S: int) -> Tensor:
    """bool [b, S] over cache slots [0, S): the prefix [0, L0) visible, [L0, L0 + K) from tree_mask [b, K], the
    rest hidden. L0: long [1] on the device (no host value needed, so the mask can be captured)."""
    b, K = tree_mask.shape
    rel = torch.arange(S, device=tree_mask.device) - L0                      # [S]: slot - L0
    picked = tree_mask.gather(1, rel.clamp(0, K - 1)[None].expand(b, S))
    return (rel < 0)[None] | (picked & ((rel >= 0) & (rel < K))[None])


def span_hidden(model: torch.nn.Module, cache: KVCache, x: Tensor, positions: Tensor, tree_mask: Tensor,
                slots: Tensor, L0: Tensor, S: int) -> Tensor:
    """The draft's layers over the key span S from the embedded tokens x [1, b, D] (what a graph captures):
    hidden [1, b, D]."""
    return model.decode(x, positions[None], span_mask(tree_mask, L0, S)[None, None], cache, slots)


def span_forward(model: torch.nn.Module, cache: KVCache, tokens: Tensor, positions: Tensor, tree_mask: Tensor,
                 slots: Tensor, L0: Tensor, S: int) -> Tensor:
    """The draft pass over the key span S: fp32 logits [b, V] (the embedding and the LM head run outside the
    graph: the embedding may live on the host, and a graph keeps only its small hidden output, not logits)."""
    x = model.embed(tokens[None])
    return model.logits(span_hidden(model, cache, x, positions, tree_mask, slots, L0, S))


@dataclass
class _Captured:
    """One graph and its static input and output buffers."""

    graph: "torch.cuda.CUDAGraph | None"
    x: Tensor
    positions: Tensor
    tree_mask: Tensor
    slots: Tensor
    L0: Tensor
    hidden: Tensor | None = None

    def load(self, x: Tensor, positions: Tensor, tree_mask: Tensor, slots: Tensor, L0: int) -> None:
        self.x.copy_(x)
        self.positions.copy_(positions)
        self.tree_mask.copy_(tree_mask)
        self.slots.copy_(slots)
        self.L0.fill_(L0)


class DraftGraphs:
    """Captured draft forwards of one model over one KV cache (see the module docstring). The cache is held
    weakly: the table of runners is keyed by it, and a strong reference here would keep every cache alive."""

    def __init__(self, model: torch.nn.Module, cache: KVCache) -> None:
        self.model, self._cache = model, weakref.ref(cache)
        self.graphs: dict[tuple[int, int, int], _Captured] = {}
        self.seen: set[tuple[int, int, int]] = set()
        self.pool = None
        self.side: "torch.cuda.Stream | None" = None     # the one stream every capture runs on
        self.failed = False
        self.ptr = cache.k.data_ptr()

    @property
    def cache(self) -> KVCache:
        cache = self._cache()
        if cache is None:
            raise RuntimeError("the draft's KV cache of this graph runner is gone")
        return cache

    def run(self, tokens: Tensor, positions: Tensor, tree_mask: Tensor, slots: Tensor) -> Tensor:
        """Same contract as DraftState.forward: fp32 logits [b, V] (a fresh tensor)."""
        cache = self.cache
        if cache.k.data_ptr() != self.ptr:               # the cache was reallocated: old graphs point at it
            self.graphs.clear()
            self.seen.clear()
            self.ptr = cache.k.data_ptr()
        L0 = cache.length
        key = (tree_mask.shape[0], tree_mask.shape[1], key_span(L0, tree_mask.shape[1], cache.capacity))
        x = self.model.embed(tokens[None])               # eager: the embedding may live on the host
        g = self.graphs.get(key)
        if g is not None:
            g.load(x, positions, tree_mask, slots, L0)
            g.graph.replay()
            return self.model.logits(g.hidden)
        L0_t = torch.full((1,), L0, dtype=torch.long, device=tokens.device)
        if key not in self.seen:
            self.seen.add(key)
            return self.model.logits(span_hidden(self.model, cache, x, positions, tree_mask, slots, L0_t, key[2]))
        try:
            return self._capture(key, x, positions, tree_mask, slots, L0_t)
        except RuntimeError as e:
            self.failed = True
            self.graphs.clear()
            warnings.warn(f"CUDA graph capture of the draft failed, running it eagerly: {e}", stacklevel=2)
            return self.model.logits(span_hidden(self.model, cache, x, positions, tree_mask, slots, L0_t, key[2]))

    def _capture(self, key: tuple[int, int, int], x: Tensor, positions: Tensor, tree_mask: Tensor,
                 slots: Tensor, L0: Tensor) -> Tensor:
        """Copy the inputs into static buffers, run the pass for real (the warm-up a capture needs), capture it."""
        S, cache = key[2], self.cache
        st = _Captured(None, x.clone(), positions.clone(), tree_mask.clone(), slots.clone(), L0.clone())

        def body() -> Tensor:
            return span_hidden(self.model, cache, st.x, st.positions, st.tree_mask, st.slots, st.L0, S)
        out, st.graph, st.hidden = self._record(body, x.device)
        self.graphs = {k: v for k, v in self.graphs.items() if k[2] == S}     # spans below are outgrown
        self.graphs[key] = st
        return self.model.logits(out)

    def _record(self, body: Callable[[], Tensor], device: torch.device
                ) -> tuple[Tensor, "torch.cuda.CUDAGraph", Tensor]:
        """(the body's real output, a CUDA graph of it, the graph's static output): the warm-up and the capture
        on a side stream that waits for the compute stream, captured thread-locally into the runner's one pool
        (see the module docstring: nothing here synchronizes the device or touches the allocator's cache)."""
        with torch.cuda.device(device):
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            if self.side is None:
                self.side = torch.cuda.Stream()
            here, side = torch.cuda.current_stream(), self.side
            side.wait_stream(here)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                out = body()
                graph.capture_begin(pool=self.pool, capture_error_mode=CAPTURE_MODE)
                try:
                    static_out = body()
                finally:
                    graph.capture_end()
            here.wait_stream(side)
            if out.is_cuda:
                out.record_stream(here)
        return out, graph, static_out
