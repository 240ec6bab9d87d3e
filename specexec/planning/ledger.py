"""The memory ledger of a run, from config.json alone: what every byte the GPU (or, on a CPU, the RAM budget)
holds is, sized for the model shapes, formats, tree budget and context of this run, and the plan built on it.

Nothing here loads or reads a weight: the sizes come from ModelArgs (config.json) and the formats (sizes.py:
the packed size of a layer in any format, KV caches, transients), the run from run_shape.py, so `specexec plan`
can answer for a checkpoint that is not downloaded and a card that is not installed. The runtime plans with the
same code before it loads anything, and prints the same ledger.

The lines of the ledger, and what each one counts, are the run's Needs (specexec/planning/needs.py); this
module plans with them: MemoryPlan (the ledger, the plan, how it is described and written as JSON),
`plan_memory` (the format and embedding placement whose predicted pass is fastest; a self-draft's layer count
and which of its layers are shared), and, when nothing fits, what would (`what_fits`); and a simulated card
for `specexec plan --gpu-memory` (`card_budget`, `card_for`).

Does not know: how layers stream (offload.streaming.pager), where the budgets come from (the caller), checkpoints.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from offload.memory_plan import GB, Bandwidths, Needs, Plan, PlanError
from offload.planner import plan

from specexec.config import PREFILL_CHUNK
from specexec.planning.experts import describe_moe, moe_summary
from specexec.planning.hot_copy_sizes import copy_bytes, hot_json
from specexec.network.mixers import fixed_layers
from specexec.planning.needs import (dtype_name, fmt_name, gb_text, needs_for, prefill_tokens, recurrent_node_bytes,
                                     recurrent_state_bytes)
from specexec.planning.run_shape import MIN_SELF_LAYERS, RunShape, self_layer_ids, with_self_draft
from specexec.tuning.depth import depth_ladder

PREFILL_RESERVE = 2048        # a streamed target reserves activations to prefill this many tokens in one pass
CUDA_CONTEXT = 500 * 10**6    # a simulated card (--gpu-memory): what the CUDA context and libraries take
ASSUMED = {"cuda": Bandwidths(ram=25e9, ssd=3e9), "cpu": Bandwidths(ram=8e9, ssd=1.5e9)}


# ----------------------------------------------------------------------------------------- planning

@dataclass(frozen=True)
class MemoryPlan:
    """A run's ledger and plan: the target layer format, each layer's tier (plan), where the embedding table
    lives, how many tokens one prefill pass of the target takes."""

    shape: RunShape
    fmt: str
    plan: Plan
    embed_on_host: bool
    prefill_tokens: int

    @property
    def context(self) -> int:
        return self.shape.context

    def ledger(self) -> dict[str, int]:
        """Every item and its bytes, flat (item names are unique across tiers)."""
        return {k: v for tier in self.plan.ledger().values() for k, v in tier.items()}

    @property
    def draft_layers(self) -> tuple[int, ...]:
        """The target layers a self-draft runs, ascending (empty for a model draft or none)."""
        return self_layer_ids(self.shape) if self.shape.self_draft is not None else ()

    @property
    def draft_copies(self) -> tuple[int, ...]:
        """The self-draft's layers it holds a copy of (the target streams them); the others are shared."""
        return tuple(i for i in self.draft_layers if self.plan.tiers[i] != "resident")

    def describe(self) -> str:
        s = self.shape
        head = (f"memory ledger: target {s.target.n_layers} layers {fmt_name(self.fmt)}" + self._draft_text()
                + f", {dtype_name(s.dtype)}, budget {s.budget} tokens, context {s.context} tokens"
                + (", KV int8 (LOSSY: no exactness claim)" if s.kv_quant == "int8" else ""))
        streamed = "" if not self.plan.streams else f"; prefill: up to {self.prefill_tokens} tokens per pass"
        moe = self.moe_json()
        return head + streamed + "\n" + self.plan.describe() + ("\n" + describe_moe(moe) if moe else "")

    def moe_json(self) -> dict | None:
        """An MoE target's experts, expert cache and per-budget pass prices (planning/experts.py); else None."""
        return moe_summary(self.plan, self.shape, self.fmt)

    def _draft_text(self) -> str:
        s = self.shape
        if s.draft is None:
            return ", no draft"
        if s.self_draft is None:
            return f", draft {s.draft.n_layers} layers {fmt_name(s.draft_fmt)}"
        ids, copies = self.draft_layers, self.draft_copies
        how = "--draft-layers auto picked " if s.self_draft.auto else ""
        hot = self.self_json()
        hot_text = (f"; {hot['hot_experts_per_layer']} hot experts per MoE layer copy, "
                    f"{gb_text(hot['hot_expert_bytes'])}" if hot["hot_layers"] else "")
        ladder = (f"; at load it measures depths {'/'.join(map(str, depth_ladder(len(ids))))} of them and drafts "
                  f"with the fastest, or gates drafting off when none beats the target alone"
                  if s.self_draft.auto else "")
        return (f", draft self ({how}{len(ids)} of {s.target.n_layers} layers {_ids(ids)}: "
                f"{len(ids) - len(copies)} shared, {len(copies)} {fmt_name(s.self_draft.fmt)} copies"
                f"{hot_text}{ladder})")

    def self_json(self) -> dict | None:
        """The self-draft's choice, for --json (None for a model draft or none)."""
        sd = self.shape.self_draft
        if sd is None:
            return None
        copies, s = self.draft_copies, self.shape
        return {"format": sd.fmt, "auto": sd.auto, "layers": list(self.draft_layers),
                "measured_depths": list(depth_ladder(len(self.draft_layers))) if sd.auto else None,
                "shared": [i for i in self.draft_layers if i not in copies], "copies": list(copies),
                "copy_bytes": sum(copy_bytes(s.target, sd.fmt, s.dtype, s.device, i) for i in copies),
                **hot_json(s.target, sd.fmt, s.dtype, s.device, copies)}

    def to_json(self) -> dict:
        p = self.plan
        return {"resident_layers": len(p.layers_in("resident")),
                "streamed_layers": {"ram": len(p.layers_in("ram")), "ssd": len(p.layers_in("ssd"))},
                "ledger": self.ledger(), "predicted_seconds_per_pass": round(p.expected_s, 4),
                "link_gbps": round(p.bandwidths.ram / GB, 3), "ssd_gbps": round(p.bandwidths.ssd / GB, 3),
                "device": p.device, "format": self.fmt, "embed_on_host": self.embed_on_host,
                "prefill_tokens": self.prefill_tokens, "read_ahead": p.read_ahead, "slots": p.n_slots,
                "budget": self.shape.budget, "context": self.shape.context,
                "gpu_budget": p.gpu_budget, "ram_budget": p.ram_budget, "warnings": list(p.warnings),
                "kv": self.kv_json(), "self_draft": self.self_json(), "moe": self.moe_json(),
                **self.recurrent_json()}

    def recurrent_json(self) -> dict:
        """A hybrid target's linear-attention layers: what one tree node adds to their cache, and the cache at
        its peak (states per sequence + the scratch of a tree of the budget); 0 and 0 without such layers."""
        fixed = fixed_layers(self.shape.target)
        return {"recurrent_layers": len(fixed),
                "recurrent_state_bytes_per_node": recurrent_node_bytes(self.shape) if fixed else 0,
                "recurrent_state_bytes": recurrent_state_bytes(self.shape) if fixed else 0}

    def kv_json(self) -> dict:
        """Where the target's KV rows live and in what format: per layer on the device or streamed with it,
        the bytes streamed per pass (at the planned context), int8 flagged as lossy."""
        p, s = self.plan, self.shape
        streamed = p.companions_streamed
        return {"quant": s.kv_quant, "lossy": s.kv_quant != "none", "draft_quant": s.draft_quant_kv,
                "device_layers": len(p.tiers) - len(streamed), "streamed_layers": len(streamed),
                "streamed_bytes_per_pass": p.companion_bytes(True), "offload": s.kv_offload}


def with_warnings(memory: MemoryPlan, warnings: tuple[str, ...]) -> MemoryPlan:
    """The plan with more warning lines (printed with it, e.g. a path on a slow file system)."""
    if not warnings:
        return memory
    return replace(memory, plan=replace(memory.plan, warnings=memory.plan.warnings + tuple(warnings)))


def plan_memory(shape: RunShape, formats: tuple[str, ...], ram: int, gpu: int | None, mode: str = "auto",
                bandwidths: Bandwidths | None = None) -> MemoryPlan:
    """Plan the run with the first target format of `formats` that fits (a list of more than one: the first
    only while every layer stays resident, e.g. ("none", "nf4") for --quant auto). When nothing fits with the
    draft's KV cache in the run dtype, the draft's cache is planned in int8 (the draft only proposes: the
    output stays exact). PlanError (one line, what would fit) when none does."""
    try:
        return _plan_formats(shape, formats, ram, gpu, mode, bandwidths)
    except PlanError:
        if shape.draft_scratch is None or shape.draft_quant_kv == "int8":
            raise
        error = sys.exc_info()[1]
    try:
        return _plan_formats(replace(shape, draft_kv_quant="int8"), formats, ram, gpu, mode, bandwidths)
    except PlanError:
        raise error from None


def _plan_formats(shape: RunShape, formats: tuple[str, ...], ram: int, gpu: int | None, mode: str,
                  bandwidths: Bandwidths | None) -> MemoryPlan:
    bw = bandwidths or ASSUMED[shape.device]
    if shape.self_draft is not None and shape.self_draft.layers is None:
        return _plan_self_auto(shape, formats, ram, gpu, mode, bw)
    for k, fmt in enumerate(formats):
        last = k + 1 == len(formats)
        try:
            chosen = _best(shape, fmt, ram, gpu, mode, bw)
        except PlanError:
            if last:
                raise
            continue
        if not last and chosen.plan.streams:
            continue                                          # auto: streamed layers take the next format
        return chosen
    raise PlanError("no target format to plan with")


def _best(shape: RunShape, fmt: str, ram: int, gpu: int | None, mode: str, bw: Bandwidths) -> MemoryPlan:
    """A plan that keeps every layer resident when there is one; else the best of the embedding placements
    (device, or host RAM when the target is untied), with the prefill reserve when it fits, else without."""
    error: PlanError | None = None
    try:
        resident = _plan_one(shape, fmt, False, 0, ram, gpu, mode, bw)
        if not resident.plan.streams:
            return resident
    except PlanError as e:
        error = e
    placements = (False,) if shape.target.tie_word_embeddings else (False, True)
    for reserve in (min(PREFILL_RESERVE, shape.context), 0):
        found = []
        for host in placements:
            try:
                m = _plan_one(shape, fmt, host, reserve, ram, gpu, mode, bw)
            except PlanError as e:
                error = e                      # the last one tried needs the least: its figures are the floor
                continue
            if m.plan.streams:                 # the table moves to RAM only for a streamed target
                found.append(m)
        if found:
            return min(found, key=lambda m: (round(m.plan.expected_s, 9), -len(m.plan.layers_in("resident")),
                                             not m.embed_on_host))
    raise error if error is not None else PlanError("nothing to plan")


def _plan_one(shape: RunShape, fmt: str, host: bool, reserve: int, ram: int, gpu: int | None, mode: str,
              bw: Bandwidths) -> MemoryPlan:
    if shape.self_draft is not None:
        needs, p = _self_placement(shape, fmt, host, reserve, ram, gpu, mode, bw)
    else:
        needs = needs_for(shape, fmt, host, reserve)
        p = plan(needs, shape.device, ram, gpu, mode, bw)
    left = p.device_budget - p.device_bytes - (p.host_bytes if p.device == "cpu" else 0)
    act = dict(needs.fixed_bytes)["activations"]
    chunk = prefill_tokens(shape, fmt, act + max(left, 0)) if p.streams else min(PREFILL_CHUNK, shape.context)
    return MemoryPlan(shape, fmt, p, host, chunk)


def what_fits(shape: RunShape, formats: tuple[str, ...], ram: int, gpu: int | None, mode: str = "auto",
              bandwidths: Bandwidths | None = None) -> str | None:
    """The first change that makes the run fit, as flags with what the plan then holds (None: none found):
    a 4-bit draft, then a smaller tree budget, a shorter context, both, and last no draft at all."""
    tries: list[tuple[str, RunShape]] = []
    sd = shape.self_draft
    if sd is not None and sd.layers is not None and not sd.auto:
        tries.append(("--draft-layers auto", replace(shape, self_draft=replace(sd, layers=None))))
    if shape.draft is not None and shape.draft_fmt == "none" and sd is None:
        tries.append(("--draft-quant nf4", replace(shape, draft_fmt="nf4")))
    budgets = [b for b in (shape.budget // 2 ** k for k in range(1, 12)) if b >= 16]
    contexts = [c for c in (2048, 1024) if c < shape.context]
    tries += [(f"--budget {b}", replace(shape, budget=b)) for b in budgets]
    tries += [(f"--context {c}", replace(shape, context=c)) for c in contexts]
    tries += [(f"--budget {b} --context {c}", replace(shape, budget=b, context=c)) for c in contexts for b in budgets]
    if shape.draft is not None:
        tries.append(("no draft", replace(shape, draft=None, draft_kv=None, self_draft=None, drafter=None)))
    for flags, candidate in tries:
        try:
            m = plan_memory(candidate, formats, ram, gpu, mode, bandwidths)
        except PlanError:
            continue
        n = len(m.plan.layers_in("resident"))
        if flags == "--draft-layers auto":
            flags = f"--draft-layers {m.shape.draft.n_layers}"
        return (f"{flags} would fit ({n} of {len(m.plan.tiers)} target layers resident, "
                f"{m.plan.expected_s:.2f} s per streamed pass)")
    return None


# ----------------------------------------------------------------------------------------- the self-draft

def _draft_layers_first(tiers: tuple[str, ...], ids: tuple[int, ...]) -> tuple[str, ...]:
    """The planner's tiers (it spreads the resident layers; every decoder layer has the same size) with the
    resident places moved onto the draft's layers first: a resident layer the draft runs needs no copy, and
    the target streams the same bytes whichever layers stay. The streamed tiers keep their order (RAM, then
    SSD) over the other layers, ascending."""
    order = [*ids, *(i for i in range(len(tiers)) if i not in set(ids))]
    resident = set(order[:tiers.count("resident")])
    streamed = iter([t for t in tiers if t != "resident"])
    return tuple("resident" if i in resident else next(streamed) for i in range(len(tiers)))


def _self_placement(shape: RunShape, fmt: str, host: bool, reserve: int, ram: int, gpu: int | None, mode: str,
                    bw: Bandwidths) -> tuple[Needs, Plan]:
    """The Needs and plan of a self-draft run, exact: which draft layers need a copy depends on which stay
    resident, which depends on what the copies cost. Start from every draft layer shared (no copies) and
    count a copy for each the plan streams until the two agree; each round can only keep fewer resident, so
    this ends at the largest consistent plan (a PlanError on the way holds for it too: it needs more)."""
    ids = self_layer_ids(shape)
    shared = frozenset(ids)
    if shape.self_draft.fmt == fmt and mode in ("auto", "none") and shape.target.moe is None:
        return _self_all_shared(shape, fmt, host, reserve, ram, gpu, mode, bw, ids)
    while True:
        needs = needs_for(shape, fmt, host, reserve, shared)
        p = plan(needs, shape.device, ram, gpu, mode, bw)
        p = replace(p, tiers=_draft_layers_first(p.tiers, ids))
        now = shared & frozenset(p.layers_in("resident"))
        if now == shared:
            return needs, p
        shared = now


def _self_all_shared(shape: RunShape, fmt: str, host: bool, reserve: int, ram: int, gpu: int | None, mode: str,
                     bw: Bandwidths, ids: tuple[int, ...]) -> tuple[Needs, Plan]:
    """Copies in a dense target's own format cost exactly what keeping those layers resident costs (an MoE
    target's copies hold H hot experts only, far less: they take the fixed point), and a resident
    layer also spares the target its stream: every draft layer stays resident, shared (PlanError when they do
    not all fit; --draft-layers auto then tries fewer). Without this a plan short of one resident place
    would fall through the fixed point to all copies and none resident."""
    needs = needs_for(shape, fmt, host, reserve, frozenset(ids))
    p = plan(needs, shape.device, ram, gpu, mode, bw)
    p = replace(p, tiers=_draft_layers_first(p.tiers, ids))
    if not frozenset(ids) <= frozenset(p.layers_in("resident")):
        raise PlanError(f"the self-draft's {len(ids)} layers do not all fit resident beside the run "
                        f"({len(p.layers_in('resident'))} do); try fewer --draft-layers")
    return needs, p


def _plan_self_auto(shape: RunShape, formats: tuple[str, ...], ram: int, gpu: int | None, mode: str,
                    bw: Bandwidths) -> MemoryPlan:
    """--draft-layers auto: the most decoder layers whose copies fit (bisection: each more layer costs memory,
    a copy or KV cache), at most half of them when the target keeps half or more of its layers resident: its
    pass then costs little more than computing them, and a draft as deep would cost nearly as much (over a
    wholly resident target, all its layers would make the draft the target itself). Half: a layer-skipping
    draft. This is the depth's upper bound: the run measures it and fewer (runtime/depth_probe.py)."""
    n = shape.target.n_layers
    sd = shape.self_draft

    def attempt(k: int) -> MemoryPlan:
        return plan_memory(with_self_draft(shape, sd.fmt, k, auto=True), formats, ram, gpu, mode, bw)

    lo, hi = min(MIN_SELF_LAYERS, n), n
    best = attempt(lo)                                  # PlanError: not even the fewest layers fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            best, lo = attempt(mid), mid
        except PlanError:
            hi = mid - 1
    half = max(MIN_SELF_LAYERS, n // 2)
    if lo > half and len(best.plan.layers_in("resident")) >= half:
        best = attempt(half)          # the target mostly resident: a deeper draft costs nearly a target pass
    return best


def card_budget(total: int) -> int:
    """GPU budget of a card with `total` bytes that is not this machine's (specexec plan --gpu-memory): the
    card minus the CUDA context (CUDA_CONTEXT) minus the margin planner.default_budgets keeps on a real GPU."""
    return int(total - CUDA_CONTEXT - max(0.05 * total, 2**29))


def card_for(budget: int) -> int:
    """The smallest card (bytes) whose card_budget is at least `budget`."""
    return int(max((budget + CUDA_CONTEXT) / 0.95, budget + CUDA_CONTEXT + 2**29)) + 1


def _ids(ids: tuple[int, ...]) -> str:
    """Layer ids for a ledger line: all of them when few, else the first and last few."""
    text = ", ".join(map(str, ids)) if len(ids) <= 8 else (", ".join(map(str, ids[:4])) + ", ..., "
                                                          + ", ".join(map(str, ids[-2:])))
    return f"[{text}]"
