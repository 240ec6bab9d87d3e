"""A streamed mixture-of-experts layer in two phases, and the device cache of hot experts.

The layer cache packs a sparse layer as its dense part (norms, attention, router, a shared expert) and then each
routed expert as its own region (specexec/checkpoints/naming.expert_regions). The pager's read-ahead moves only
the dense part (offload/streaming/parts.py: the layer's head) into the slot; the layer runs its attention and
router, and the Block hands the routing of every row of the pass (every node of the tree) to the model's
RoutingLog before any expert runs (specexec/network/model.py). `ExpertStream` is that log: at `record` it finds the
pass's distinct experts (the layer's one host sync: the union over every row is exact, not predicted), binds
the ones the device expert cache holds to their cache copies (no copy; each such entry is pinned until the
layer's `combine` has run), and asks the pager for the others'
regions (`fill_ranges`: from the RAM tier or, per expert, from the SSD tier), which land at their offsets in
the slot where the Block's experts are already bound. Then the experts run. Bytes are the same as a resident
layer's, so the output is the resident model's, bit for bit.

`ExpertCache`: per streamed sparse layer, room for `per_layer` experts on the device (the plan's expert cache:
offload Plan.cached_parts), kept for the most often routed-to experts of that layer (decayed counts of the
passes that routed to each): an expert fetched into a slot whose count ranks it among the hottest is also copied
into the cache (a device copy), evicting a colder one that no expert of the pass in flight is bound to: an entry a
pass has bound (`take`) is pinned until `release` (ExpertStream.combine, once the layer's experts ran; on CUDA the
copy into a freed entry is queued after them on the same stream), so a row routed to expert h is computed with
h's bytes whatever the ranking says. Counters (what stats.moe reports): bytes of experts
moved into slots, routed experts looked up in streamed layers and found in the cache, cached experts evicted.

On a CPU the "device" is the CPU: the same mechanism runs (the cache saves a RAM-tier memcpy or a disk read).

Layers whose experts compute on the CPU (--experts cpu, `cpu`: runtime/cpu_experts.py) copy no expert: `record`
leaves them alone and `combine` hands their feed-forward to the CPU experts.

Does not know: trees, tokens, how bytes move (the pager's), the engine.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from offload.quant.linear import bind_module
from offload.streaming.storage import LayerLayout, unpack_region

from specexec.checkpoints.naming import EXPERT_PREFIX
from specexec.companions.experts import ExpertPasses
from specexec.network.moe import RoutingLog, Routing

COUNT_DECAY = 0.95          # an expert's routing count halves in ~14 passes without it


def bind_expert(block: nn.Module, e: int, views: dict[str, Tensor], meta: dict,
                weights: dict[str, object] | None = None) -> None:
    """Point expert e of a sparse Block at views of its own region (full packed names, e.g. those of
    unpack_region); no copy. weights: expert e's part of meta["weights"] under its own names, when the caller
    keeps it (by_expert; a scan of the layer's every tensor otherwise)."""
    prefix = f"{EXPERT_PREFIX}{e}."
    rel = {k[len(prefix):]: v for k, v in views.items() if k.startswith(prefix)}
    if weights is None:
        weights = {k[len(prefix):]: w for k, w in meta["weights"].items() if k.startswith(prefix)}
    bind_module(block.mlp.experts[e], rel, {**meta, "weights": weights})


def bind_experts(block: nn.Module, views: dict[str, Tensor], meta: dict) -> None:
    """Every expert of a sparse Block at its views in `views` (full packed names: a whole layer's), the layer's
    names split by expert once (E experts bound in O(E), not O(E^2))."""
    rel, weights = by_expert(views), by_expert(meta["weights"])
    for e, expert in enumerate(block.mlp.experts):
        bind_module(expert, rel.get(e, {}), {**meta, "weights": weights.get(e, {})})


def by_expert(named: dict[str, object]) -> dict[int, dict[str, object]]:
    """The entries named mlp.experts.{e}.* split by expert (e -> its entries under their own names), one pass."""
    out: dict[int, dict[str, object]] = {}
    for k, v in named.items():
        if k.startswith(EXPERT_PREFIX):
            e, _, rest = k[len(EXPERT_PREFIX):].partition(".")
            out.setdefault(int(e), {})[rest] = v
    return out


class ExpertCache:
    """Device copies of the hottest experts of each streamed sparse layer (see the module docstring)."""

    def __init__(self, layouts: dict[int, LayerLayout], n_experts: int, per_layer: int, device: torch.device) -> None:
        self.layouts, self.n_experts, self.per_layer = layouts, n_experts, per_layer
        self.counts = {i: torch.zeros(n_experts, dtype=torch.float64) for i in layouts}
        self.where: dict[int, dict[int, int]] = {i: {} for i in layouts}         # layer -> expert -> entry
        self.views: dict[tuple[int, int], dict[str, Tensor]] = {}
        self.pinned: dict[int, set[int]] = {i: set() for i in layouts}          # layer -> entries bound now
        self.buffers = {i: torch.empty(per_layer, lay.regions[0].nbytes, dtype=torch.uint8, device=device)
                        for i, lay in layouts.items()} if per_layer else {}

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    def held(self, i: int) -> set[int]:
        return set(self.where.get(i, {}))

    def observe(self, i: int, experts: Sequence[int]) -> None:
        """The pass routed rows of layer i to `experts`: decayed counts."""
        c = self.counts[i]
        c.mul_(COUNT_DECAY)
        c[list(experts)] += 1.0

    def take(self, i: int, e: int) -> dict[str, Tensor] | None:
        """Views of expert e of layer i in the cache (full packed names), pinned until `release(i)`; or None."""
        entry = self.where[i].get(e)
        if entry is None:
            return None
        self.pinned[i].add(entry)
        return self.views[(i, entry)]

    def release(self, i: int) -> None:
        """Layer i's experts have run: the entries its pass bound may be overwritten again."""
        self.pinned[i].clear()

    def offer(self, i: int, experts: Sequence[int], slot: Tensor) -> int:
        """Experts of layer i just brought into `slot` (the layer's packed bytes): keep the hottest of them, each
        in a free entry or in place of a colder cached one that is not pinned. Returns how many it evicted."""
        evicted = 0
        if not self.per_layer:
            return evicted
        counts, where, lay, pinned = self.counts[i], self.where[i], self.layouts[i], self.pinned[i]
        for e in sorted(experts, key=lambda x: -float(counts[x])):
            if len(where) < self.per_layer:
                entry = len(where)
            else:
                free = [x for x, j in where.items() if j not in pinned]
                coldest = min(free, key=lambda x: float(counts[x]), default=None)
                if coldest is None or float(counts[coldest]) >= float(counts[e]):
                    continue
                entry = where.pop(coldest)
                evicted += 1
            r = lay.region(f"{EXPERT_PREFIX}{e}.")
            buf = self.buffers[i][entry]
            buf.copy_(slot[r.offset:r.offset + r.nbytes])
            where[e] = entry
            self.views[(i, entry)] = unpack_region(buf, lay, r.name)
        return evicted


class ExpertStream(RoutingLog):
    """The RoutingLog of an offloaded MoE target: brings each streamed sparse layer's routed experts onto the
    device as the layer routes (see the module docstring). `model` is the OffloadedTransformer; its `current`
    says which layer, slot and Block the pager handed out last."""

    def __init__(self, model: nn.Module, cache: ExpertCache, cpu=None) -> None:
        """cpu: the layers whose experts compute on the CPU (a runtime.cpu_experts.CpuExperts, or None)."""
        super().__init__()
        self.model, self.cache, self.cpu = model, cache, cpu
        self._weights: dict[int, dict[int, dict[str, object]]] = {}     # layer -> by_expert of its meta weights
        self.counters = {"expert_bytes": 0.0, "expert_hits": 0.0, "expert_lookups": 0.0, "expert_evictions": 0.0}

    def all_counters(self) -> dict[str, float]:
        """The expert counters, with the CPU experts' (cpu_experts.py) where some layers compute there."""
        return {**self.counters, **(self.cpu.counters if self.cpu is not None else {})}

    def combine(self, layer: int, mlp: nn.Module, h: Tensor, routing: Routing) -> Tensor:
        """The layer's experts run (on the CPU for a CPU layer); then the cache entries it bound are free."""
        if self.cpu is not None and layer in self.cpu:
            return self.cpu.combine(layer, mlp, h, routing)
        out = mlp.combine(h, routing)
        if layer in self.cache.pinned:
            self.cache.release(layer)
        return out

    def record(self, layer: int, routing: Routing) -> None:
        super().record(layer, routing)
        i, slot, block, buf = self.model.current
        if i != layer or slot < 0:                    # a resident layer holds every expert
            return
        if self.cpu is not None and layer in self.cpu:    # its experts compute in RAM: nothing to copy
            return
        experts = routing.experts()                   # the layer's one host sync
        lay = self.model.layouts[i]
        meta = lay.meta
        need = []
        self.cache.release(i)                         # (pins of a pass that never reached its combine)
        if i not in self._weights:
            self._weights[i] = by_expert(meta["weights"])
        for e in experts:
            views = self.cache.take(i, e)
            if views is not None:
                bind_expert(block, e, views, meta, self._weights[i].get(e, {}))
            else:
                need.append(e)
        ranges = [(r.offset, r.nbytes) for r in (lay.region(f"{EXPERT_PREFIX}{e}.") for e in need)]
        moved = self.model.pager.fill_ranges(i, slot, ranges)
        self.counters["expert_bytes"] += moved
        self.counters["expert_hits"] += len(experts) - len(need)
        self.counters["expert_lookups"] += len(experts)
        self.cache.observe(i, experts)
        self.counters["expert_evictions"] += self.cache.offer(i, need, buf)


def expert_passes(target: nn.Module, tiers: Sequence[str] | None = None, ram_bps: float = 0.0,
                  ssd_bps: float = 0.0, device: torch.device | str = "cpu", mode: str = "experts"
                  ) -> ExpertPasses | None:
    """The engine's MoE companion for this target (None for a dense one), with the cost of a pass the plan
    implies: per sparse layer, seconds to bring one expert onto the device from its tier (its region's bytes
    over the tier's bandwidth; 0 when resident), and as the rest of a pass the dense parts' bytes of the
    streamed layers over theirs (flat in the rows: compute assumed hidden behind the copies, as the plan
    assumes). tiers None: a resident target (every expert held: nothing to price, stats only)."""
    args = target.args
    if args.moe is None:
        return None
    sparse = [i for i in range(args.n_layers) if args.moe.sparse(i)]
    layouts = getattr(target, "layouts", None)
    if layouts is None or tiers is None:
        expert = target.layers[sparse[0]].mlp.experts[0]
        nbytes = sum(p.numel() * p.element_size() for p in expert.parameters())
        return ExpertPasses(args, expert_bytes=nbytes, mode=mode, device=device)
    rate = {"ram": ram_bps, "ssd": ssd_bps}
    nbytes = layouts[sparse[0]].regions[0].nbytes if layouts[sparse[0]].regions else 0
    seconds = [0.0 if tiers[i] == "resident" or not rate[tiers[i]] else nbytes / rate[tiers[i]] for i in sparse]
    base = sum(layouts[i].dense_nbytes / rate[t] for i, t in enumerate(tiers) if t != "resident" and rate[t])
    return ExpertPasses(args, torch.tensor(seconds, dtype=torch.float64), nbytes, base=lambda rows: base,
                        mode=mode, device=device)
