"""The self-draft's copies of an MoE target's streamed sparse layers: the dense part and H hot experts each.

A copy of a sparse layer (specexec/planning/hot_copy_sizes.py sizes it: H = HOT_FACTOR x top-k) is a Block whose
norms, attention, router and shared expert are bound to a resident copy of the layer's dense part, and whose
experts hold H of the E routed experts, each in its own entry of a [H, expert bytes] buffer (the layer cache's
per-expert regions in the draft's format, read alone: offload/cache/store.read_region). Its router masks the
experts it does not hold (network/moe.Router.allowed: they score -inf before the top-k), so each draft row goes to
its top-k among the held ones; an expert it does not hold is a module on the meta device, never bound to bytes.
The draft is an approximation of the target: the target verifies every node, so the output stays the target's.

Which experts: the hottest H of each layer by the target's routing counts (tuning/routing.RoutingStats, which the
engine's ExpertPasses feeds after every verification pass). `HotExperts.observe` is called after each pass; after
the first (the prompt's prefill: many rows, so a fair first ranking) and then every RERANK_PASSES passes it
re-ranks and replaces the copies of experts that fell out of the top H by the ones that came in (reads from the
layer cache, binds; the others stay). Before any pass: experts 0 .. H-1.

Counters: bytes read into copies (the initial load included), experts replaced, re-rankings.

Does not know: the engine or trees (it is told of passes), which layers the draft runs (self_draft.py), how the
target streams.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from offload.cache.store import LayerCache
from offload.quant.linear import QuantLinear, bind_module, swap_linears
from offload.streaming.storage import LayerLayout, unpack_layer, unpack_region
from offload.streaming.tiers import host_buffer

from specexec.checkpoints.naming import EXPERT_PREFIX
from specexec.config import ModelArgs
from specexec.network.model import Block, on_meta
from specexec.planning.hot_copy_sizes import hot_per_layer
from specexec.runtime.expert_stream import bind_expert

RERANK_PASSES = 4         # target passes between two re-rankings of the hot experts (after the first)
Say = Callable[[str], None]


def reranks_after(passes: int) -> bool:
    """Whether the copies re-rank after target pass number `passes` (1-based): the first, then every RERANK_PASSES."""
    return passes == 1 or passes % RERANK_PASSES == 0


def dense_views(buf: Tensor, layout: LayerLayout) -> dict[str, Tensor]:
    """Views of a sparse layer's dense-part tensors in `buf`, which holds that part's bytes alone (its
    layout.dense_nbytes, offsets as in the layer); nothing is copied."""
    dense = tuple(e for e in layout.entries if e.offset < layout.dense_nbytes)
    return unpack_layer(buf, LayerLayout(dense, layout.dense_nbytes, layout.meta))


class HotExperts:
    """Copies of the sparse layers `layers` of a self-draft, H experts each (see the module docstring).
    `blocks[i]` is layer i's Block; `held[i]` the expert in each of its H entries (-1: empty)."""

    def __init__(self, args: ModelArgs, cache: LayerCache, layers: Sequence[int], fmt: str, like: Tensor,
                 per_layer: int | None = None) -> None:
        self.args, self.cache, self.fmt = args, cache, fmt
        self.device, self.dtype = like.device, like.dtype
        self.per_layer = hot_per_layer(args) if per_layer is None else per_layer
        if not args.moe.top_k <= self.per_layer <= args.moe.n_experts:
            raise ValueError(f"{self.per_layer} hot experts for a top-{args.moe.top_k} router of "
                             f"{args.moe.n_experts} experts")
        self.layers = tuple(layers)
        self.blocks: dict[int, Block] = {}
        self.held: dict[int, list[int]] = {}
        self._dense: dict[int, Tensor] = {}
        self._entries: dict[int, Tensor] = {}
        self._empty: dict[int, nn.Module] = {}
        self.counters = {"hot_expert_bytes_read": 0.0, "hot_experts_replaced": 0.0, "hot_reranks": 0.0}
        self.passes = 0
        biggest = max(max(cache.layout(i).dense_nbytes, cache.layout(i).regions[0].nbytes) for i in self.layers)
        self._bounce = host_buffer(biggest) if self.device.type == "cuda" else None
        for i in self.layers:
            self._build(i)

    def _read(self, out: Tensor, read: Callable[[Tensor], object], expert: bool = True) -> None:
        """Bytes into `out` (on the device): read(host buffer) straight into it on a CPU, through the bounce
        buffer on CUDA; an expert's bytes are counted."""
        if self._bounce is None:
            read(out)
        else:
            host = self._bounce[:out.numel()]
            read(host)
            out.copy_(host)
        if expert:
            self.counters["hot_expert_bytes_read"] += out.numel()

    def _build(self, i: int) -> None:
        """Layer i's Block: the dense part read and bound, every expert empty, then experts 0 .. H-1."""
        lay = self.cache.layout(i)
        with on_meta():
            block = Block(self.args, i)
        swap_linears(block, self.fmt, self.dtype)
        for m in block.modules():
            if isinstance(m, QuantLinear):
                m.row_exact = False
        self._empty[i] = copy.deepcopy(block.mlp.experts[0])           # an unbound (meta) expert
        dense = torch.empty(lay.dense_nbytes, dtype=torch.uint8, device=self.device)
        self._read(dense, lambda out: self.cache.read_part(i, 0, out), expert=False)
        experts, block.mlp.experts = block.mlp.experts, nn.ModuleList()     # bind all but the experts
        try:
            bind_module(block, dense_views(dense, lay), lay.meta)
        finally:
            block.mlp.experts = experts
        self._dense[i] = dense
        self._entries[i] = torch.empty(self.per_layer, lay.regions[0].nbytes, dtype=torch.uint8, device=self.device)
        self.blocks[i] = block.eval().requires_grad_(False)
        self.held[i] = [-1] * self.per_layer
        block.mlp.router.allowed = torch.zeros(self.args.moe.n_experts, dtype=torch.bool, device=self.device)
        self.hold(i, range(self.per_layer))

    def hold(self, i: int, experts: Sequence[int]) -> int:
        """Make layer i's copy hold `experts` (at most H): the ones it holds already stay in their entries, the
        others take the entries of those that leave. Returns how many experts were read."""
        want = list(dict.fromkeys(int(e) for e in experts))[:self.per_layer]
        held, block, lay = self.held[i], self.blocks[i], self.cache.layout(i)
        free = [j for j, e in enumerate(held) if e not in want]
        new = [e for e in want if e not in held]
        for j, e in zip(free, new):
            old = held[j]
            if old >= 0:
                block.mlp.experts[old] = copy.deepcopy(self._empty[i])   # never again bound to these bytes
            name = f"{EXPERT_PREFIX}{e}."
            buf = self._entries[i][j]
            self._read(buf, lambda out, name=name: self.cache.read_region(i, name, out))
            bind_expert(block, e, unpack_region(buf, lay, name), lay.meta)
            held[j] = e
        allowed = block.mlp.router.allowed
        allowed.zero_()
        allowed[[e for e in held if e >= 0]] = True
        return len(new)

    def observe(self, counts: Tensor, layers: Sequence[int]) -> float:
        """After a target pass: counts [L, E] (routing counts of the target's sparse layers `layers`, in that
        order). After the first pass and every RERANK_PASSES passes each copy takes its layer's H hottest experts.
        Returns the expert bytes read (0: no re-ranking, or nothing changed)."""
        self.passes += 1
        if not reranks_after(self.passes):
            return 0.0
        before = self.counters["hot_expert_bytes_read"]
        row = {layer: j for j, layer in enumerate(layers)}
        for i in self.layers:
            c = counts[row[i]].double().cpu()
            hottest = torch.sort(-c, stable=True).indices[:self.per_layer].tolist()   # ties: lower id first
            self.counters["hot_experts_replaced"] += self.hold(i, hottest)
        self.counters["hot_reranks"] += 1
        return self.counters["hot_expert_bytes_read"] - before

    def nbytes(self) -> int:
        """Device bytes of the copies (dense parts and expert entries)."""
        return sum(t.numel() for t in (*self._dense.values(), *self._entries.values()))

    def close(self) -> None:
        self.cache.close()
