"""Memory planner: from a GPU budget, a RAM budget and the sizes of everything a run holds, decide the tier of
each of the target's decoder layers (resident | ram | ssd) and what one streamed pass is expected to cost.

`plan()` is a pure function of its arguments (no torch, no psutil): tests call it with made-up sizes.
`default_budgets()` is the only part that asks the machine (torch.cuda.mem_get_info, psutil) what is free.

What pays for what (see ../shared/DESIGN.md, "Memory tiers"):
- CUDA: the GPU budget pays, in order, the target's embeddings/norm/head, the draft, both KV caches, the
  activations of the largest tree and the streaming slots (only when something streams); then as many target
  layers as fit stay resident. The RAM budget holds the next layers as pinned packed buffers, plus the pinned
  bounce buffers the SSD reader fills when any layer lives on the SSD. The rest stream from the SSD.
- CUDA host side: the RAM budget pays first the host-side fixed costs (e.g. the target's input embedding
  table when it is kept in RAM), then the RAM tier, then the SSD bounce buffers.
- CPU: there is no device memory: --ram-budget bounds everything held in memory (fixed costs, resident layers,
  the slots that streamed layers are read into) and the remaining layers stream from the SSD tier. The RAM
  tier on CPU (a second copy of a layer in plain memory) is only used when asked for (--offload ram).

Companions (e.g. a layer's KV cache rows): bytes that belong to one layer and must stay in memory. Held on
the device with a resident layer. A streamed layer's companion either stays on the device too, or lives in
host RAM (never on the SSD) and travels with the layer into a device stage each pass (n_slots stages of the
largest streamed companion, plus a small per-layer residue it keeps on the device): that moves its bytes
every pass but frees device memory for resident layers. On CUDA (auto) the planner tries every number of
resident layers and keeps, for each, as many companions on the device as fit; it picks the smallest expected
pass time (more resident layers on a tie), but streams companions only when nothing fits without, or when
that saves at least COMPANION_GAIN of the pass: their copies add host work (write-backs, top-ups of a
read-ahead made before the commit) that the byte count does not show. On a CPU moving a companion saves nothing
(the device is RAM), so it streams only when asked (`companions="stream"`, for tests and benchmarks).

Order (CUDA): the resident layers are spread among the streamed ones (`interleave`), so the link copies while
they compute; the choice of how many stays resident is made on counts, and dense layers are interchangeable.

Read-ahead depth (how many layers the SSD reader may hold ahead of the consumer: pinned bounce buffers on
CUDA, host slots on CPU) starts at the minimum the Needs give (2) and grows into whatever budget is LEFT once
every layer has its tier, up to MAX_READ_AHEAD and the number of SSD layers. It never displaces a layer: a
layer kept resident (or in the RAM tier) saves its read on every pass, a deeper read-ahead at most the reads
that fit in the drafting time, so a layer is always worth at least as much as a buffer of its size. With
--offload ssd (nothing else competes for RAM) the read-ahead is as deep as the cap allows.

Sub-regions (Needs.parts: e.g. the experts of a mixture of experts): a streamed layer with them costs its dense
region plus the sub-regions a pass is expected to read (the caller's estimate, Parts.reads), and the device
memory left once every layer has its tier becomes a cache of the most often read sub-regions of each streamed
one (`_with_part_cache`: as many per layer as fit, the same number for each; not in modes ram and ssd). On CUDA the choice of how many
layers stay resident counts the cache each candidate leaves room for (a resident layer against the sub-regions
its bytes would cache elsewhere); on a CPU the cache takes what the resident layers leave, before read-ahead.

`Plan.ledger()` names every byte each budget holds (the device side, the host side, the disk); `describe()`
prints it with the predicted seconds per pass.

The inputs and the result (Needs, Bandwidths, Plan, PlanError) are offload/memory_plan.py; this module decides.

Does not know: models, tokens, how bytes move (tiers.py/pager.py), or where the sizes came from.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import accumulate

from offload.memory_plan import (
    COMPANION_GAIN, COMPANION_MODES, OFFLOAD_MODES, Bandwidths, Needs, Plan, PlanError, gb_text)


def plan(needs: Needs, device: str, ram_budget: int, gpu_budget: int | None = None, mode: str = "auto",
         bandwidths: Bandwidths = Bandwidths()) -> Plan:
    """Assign every decoder layer a tier. device: "cuda" or "cpu". mode: auto (from the budgets), none (all
    resident), ram (all streamed from RAM), ssd (all streamed from disk). Raises PlanError when the budgets
    cannot hold the run, saying what would fit."""
    if mode not in OFFLOAD_MODES:
        raise PlanError(f"unknown offload mode {mode!r}; choose one of: {', '.join(OFFLOAD_MODES)}")
    if device not in ("cuda", "cpu"):
        raise PlanError(f"unknown device kind {device!r}; the planner knows cuda and cpu")
    if device == "cuda" and gpu_budget is None:
        raise PlanError("a CUDA plan needs a GPU budget")
    if device == "cpu" and needs.host_fixed:
        raise ValueError("on CPU every fixed cost is RAM: pass it in fixed_bytes, not host_fixed")
    warnings: tuple[str, ...] = ()
    if device == "cpu" and gpu_budget is not None:
        warnings = ("--gpu-budget means nothing without CUDA: it is ignored; --ram-budget bounds what is held "
                    "in memory",)
        gpu_budget = None
    if needs.companions not in COMPANION_MODES:
        raise PlanError(f"unknown companion mode {needs.companions!r}; choose one of: {', '.join(COMPANION_MODES)}")
    if device == "cuda":
        tiers, companions = interleave(*_assign_cuda(needs, gpu_budget, ram_budget, mode, bandwidths), needs)
    else:
        tiers, companions = _assign_cpu(needs, ram_budget, mode)
    base = Plan(device, tiers, needs, gpu_budget, ram_budget, bandwidths, warnings, mode,
                streamed_companions=companions)
    return _deepen_read_ahead(_with_part_cache(base))


def _with_part_cache(p: Plan) -> Plan:
    """The plan with a device cache of sub-regions (Needs.parts) in the device budget left over: the same
    number for each streamed layer that has them, at most all of them (unchanged without parts, and in modes
    ram and ssd, which stream every layer whole as asked, as they keep none resident)."""
    parts = p.needs.parts
    if parts is None or not p.parts_streamed or not parts.each or p.mode not in ("auto", "none"):
        return p
    left = p.device_budget - p.device_bytes - (p.host_bytes if p.device == "cpu" else 0)
    return replace(p, cached_parts=int(max(min(parts.count, left // (parts.each * p.parts_streamed)), 0)))


def interleave(tiers: tuple[str, ...], companions: tuple[bool, ...], needs: Needs
               ) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """The same tiers with the resident layers spread evenly among the streamed ones (resident j of k at layer
    about (j + 1/2) n / k), the streamed ones keeping their order (RAM, then SSD; device companions first).
    A pass computes its layers in order and the slots were filled while the draft grew its tree: resident
    layers all first would be computed while the link idles (every slot already full), all last after its
    final copy. Spread, each one computes while the next streamed layer copies. Only when every layer is
    interchangeable (same packed size, companion and residue: every dense model), so each budget holds the
    same bytes; otherwise the tiers are returned as they are."""
    n, k = len(tiers), tiers.count("resident")
    if not 0 < k < n or len({(needs.layer_bytes[i], needs.companion(i), needs.residue(i)) for i in range(n)}) > 1:
        return tiers, companions
    places = {int((j + 0.5) * n / k) for j in range(k)}
    streamed = iter([(t, c) for t, c in zip(tiers, companions) if t != "resident"])
    pairs = [("resident", False) if i in places else next(streamed) for i in range(n)]
    return tuple(t for t, _ in pairs), tuple(c for _, c in pairs)


def _deepen_read_ahead(p: Plan) -> Plan:
    """The plan with the SSD read-ahead grown into the budget left over (never below the Needs' minimum, never
    above MAX_READ_AHEAD or the number of SSD layers): bounce buffers in RAM on CUDA, slots on CPU."""
    n_ssd = len(p.layers_in("ssd"))
    if not n_ssd or not p.slot_bytes:
        return p
    cap = max(min(p.needs.max_read_ahead, n_ssd), 0)
    if p.device == "cuda":
        extra = (p.ram_budget - p.host_bytes) // p.slot_bytes
        return replace(p, bounce=max(p.n_bounce, min(cap, p.n_bounce + extra)))
    per_slot = p.slot_bytes + max((p.needs.companion(i) for i in p.companions_streamed), default=0)   # + a stage
    extra = (p.ram_budget - p.device_bytes - p.host_bytes) // per_slot
    return replace(p, slots=max(p.n_slots, min(cap, p.n_slots + extra)))


def _assign_cuda(needs: Needs, gpu: int, ram: int, mode: str, bw: Bandwidths
                 ) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """(tier per layer, companion streamed per layer): everything resident when it fits (or mode none), else
    the cheapest candidate of `_candidate` over the number of resident layers (auto) or none (ram, ssd)."""
    n, sizes = len(needs.layer_bytes), needs.layer_bytes
    whole = needs.fixed + sum(sizes) + sum(needs.companion(i) for i in range(n))
    if mode == "none" or (mode == "auto" and whole <= gpu):
        _check(whole, gpu, "--gpu-budget", lambda: _fixed_text(needs, whole - needs.fixed - sum(sizes))
               + f" and all {n} target layers resident ({gb_text(sum(sizes))})", lambda: _resident_hint(needs, gpu))
        return ("resident",) * n, (False,) * n
    best, plain, error = None, None, None
    sums = _Sums.of(needs)
    for k in (range(n - 1, -1, -1) if mode == "auto" else (0,)):
        try:
            cand = _candidate(needs, sums, k, gpu, ram, mode, bw)
        except PlanError as e:
            error = (error or e) if k else e                  # k = 0 needs the least GPU: its error says most
            continue
        if needs.parts is not None:                           # seconds with the cache this candidate leaves room for
            trial = _with_part_cache(Plan("cuda", cand[0], needs, gpu, ram, bw, streamed_companions=cand[1]))
            cand = (cand[0], cand[1], trial.expected_s)
        if best is None or cand[2] < best[2] - 1e-12:         # a tie keeps more resident layers
            best = cand
        if not any(cand[1]) and (plain is None or cand[2] < plain[2] - 1e-12):
            plain = cand
    if best is None:
        raise error
    if plain is not None and best[2] >= (1 - COMPANION_GAIN) * plain[2]:
        best = plain                                          # streaming companions must pay for itself
    return best[0], best[1]


@dataclass(frozen=True)
class _Sums:
    """Running sums over the layers of one Needs, so that each of the n candidates costs O(log n), not O(n):
    sizes[k], comps[k], residues[k] total the first k layers (n + 1 entries each); comp_max_from[k] is the
    largest companion of layers k .. n-1 (0 at k = n)."""

    sizes: tuple[int, ...]
    comps: tuple[int, ...]
    residues: tuple[int, ...]
    comp_max_from: tuple[int, ...]

    @staticmethod
    def of(needs: Needs) -> _Sums:
        n = len(needs.layer_bytes)
        comps = [needs.companion(i) for i in range(n)]
        tail = list(accumulate(reversed(comps), max, initial=0))[::-1]
        return _Sums(tuple(accumulate(needs.layer_bytes, initial=0)), tuple(accumulate(comps, initial=0)),
                     tuple(accumulate((needs.residue(i) for i in range(n)), initial=0)), tuple(tail))

    def fit(self, start: int, room: int) -> int:
        """How many layers from `start` on fit in `room` bytes (as _fit_prefix over sizes[start:])."""
        return max(bisect_right(self.sizes, self.sizes[start] + room) - 1 - start, 0) if room >= 0 else 0


def _candidate(needs: Needs, sums: _Sums, k: int, gpu: int, ram: int, mode: str, bw: Bandwidths
               ) -> tuple[tuple[str, ...], tuple[bool, ...], float]:
    """The first k layers resident (with their companions), the rest streamed: as many of their companions
    on the device as the GPU budget leaves room for (by the companion mode), the others in RAM; streamed
    layers in RAM, then on the SSD. (tiers, companions streamed, expected seconds per pass); PlanError when
    a budget cannot hold it. Error texts are built only when raised (this runs once per resident count)."""
    n, c = len(needs.layer_bytes), sums.comps
    slots = needs.n_slots * needs.max_layer
    base = needs.fixed + sums.sizes[k] + c[k] + slots
    stage = needs.n_slots * sums.comp_max_from[k] + sums.residues[n] - sums.residues[k]
    on_device = c[k] + (c[n] - c[k] if needs.companions == "device" else stage)
    what = "" if needs.companions == "device" or k else " stages"
    _check(base - c[k] + on_device, gpu, "--gpu-budget", lambda: _fixed_text(needs, on_device, what)
           + f" and {needs.n_slots} streaming slots ({gb_text(slots)})" + (f" and {k} resident layers" if k else ""),
           "lower --budget (smaller trees need less activation memory), a shorter --context, or use a smaller "
           "draft or quantize it (--draft-quant)")
    keep = _device_companions(needs, sums, k, gpu - base, stage)
    companions = (False,) * (k + keep) + (True,) * (n - k - keep)
    streamed_c = c[n] - c[k + keep]
    bounce_bytes = needs.n_bounce * needs.max_layer
    if mode in ("ram", "ssd"):
        n_ram = n if mode == "ram" else 0
        tiers = (mode,) * n
    else:
        room = ram - needs.host - streamed_c
        n_ram = sums.fit(k, room)
        if k + n_ram < n:
            n_ram = sums.fit(k, room - bounce_bytes)      # the SSD then needs bounce buffers
        tiers = ("resident",) * k + ("ram",) * n_ram + ("ssd",) * (n - k - n_ram)
    in_ram = sums.sizes[k + n_ram] - sums.sizes[k]               # k = 0 in modes ram and ssd
    bounce = bounce_bytes if "ssd" in tiers else 0

    def held() -> str:
        parts = [f"{name} ({gb_text(b)})" for name, b in needs.host_fixed if b]
        parts += [f"{needs.companion_name} of {n - k - keep} layers ({gb_text(streamed_c)})"] if streamed_c else []
        parts += [f"{n_ram} pinned layers"] if n_ram else []
        parts += [f"{needs.n_bounce} SSD bounce buffers ({gb_text(bounce)})"] if bounce else []
        return " and ".join(parts)

    _check(needs.host + streamed_c + in_ram + bounce, ram, "--ram-budget", held,
           "use --offload ssd or auto to stream from disk instead" if mode == "ram" else "free some RAM")
    ssd = sums.sizes[n] - sums.sizes[k] - in_ram
    return tiers, companions, (in_ram + streamed_c) / bw.ram + ssd / bw.ssd


def _device_companions(needs: Needs, sums: _Sums, k: int, room: int, stage: int) -> int:
    """How many of the streamed layers' companions (from layer k on, in order) stay on the device in `room`
    bytes: all when they fit (or the mode says device), none when the mode says stream, else as many as fit
    beside the stages and the residues of the others."""
    n = len(needs.layer_bytes)
    if needs.companions == "device" or (needs.companions == "auto" and sums.comps[n] - sums.comps[k] <= room):
        return n - k
    if needs.companions == "stream":
        return 0
    return _fit_prefix(tuple(needs.companion(i) - needs.residue(i) for i in range(k, n)), room - stage)


def _assign_cpu(needs: Needs, ram: int, mode: str) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """On a CPU companions are RAM wherever they are: they stream only in companion mode "stream" (then
    their stages count too)."""
    n, sizes = len(needs.layer_bytes), needs.layer_bytes
    comp = sum(needs.companion(i) for i in range(n))
    if mode == "none" or (mode == "auto" and needs.fixed + comp + sum(sizes) <= ram):
        _check(needs.fixed + comp + sum(sizes), ram, "--ram-budget", _fixed_text(needs, comp) + f" and all {n} target "
               f"layers ({gb_text(sum(sizes))})", _resident_hint(needs, ram))
        return ("resident",) * n, (False,) * n
    stream = needs.companions == "stream" and comp > 0
    stage = needs.n_slots * max(needs.companion_bytes) + sum(needs.residue(i) for i in range(n)) if stream else 0
    slots = needs.n_slots * needs.max_layer + stage
    fixed = needs.fixed + comp
    if mode == "ram":
        _check(fixed + slots + sum(sizes), ram, "--ram-budget", _fixed_text(needs, comp) + f", {needs.n_slots} "
               f"slots ({gb_text(slots)}) and a RAM tier of all {n} layers ({gb_text(sum(sizes))})",
               "use --offload ssd or auto to stream from disk instead")
        tiers = ("ram",) * n
    else:
        _check(fixed + slots, ram, "--ram-budget", _fixed_text(needs, comp) + f" and {needs.n_slots} streaming slots "
               f"({gb_text(slots)})", "lower --budget or use a smaller draft or quantize it (--draft-quant)")
        k = 0 if mode == "ssd" else _fit_prefix(sizes, ram - fixed - slots)
        tiers = ("resident",) * k + ("ssd",) * (n - k)
    return tiers, tuple(stream and t != "resident" for t in tiers)


def _fit_prefix(sizes: tuple[int, ...], room: int) -> int:
    """How many leading layers fit in `room` bytes."""
    used = 0
    for k, b in enumerate(sizes):
        if used + b > room:
            return k
        used += b
    return len(sizes)


def _fixed_text(needs: Needs, companions: int = 0, what: str = "") -> str:
    """The fixed costs by name, plus `companions` bytes of the companions (on the device) when given."""
    parts = [f"{name} ({gb_text(b)})" for name, b in needs.fixed_bytes if b]
    if companions:
        parts.append(f"{needs.companion_name}{what} ({gb_text(companions)})")
    return ", ".join(parts) if parts else "nothing fixed"


def _resident_hint(needs: Needs, budget: int) -> str:
    k = _fit_prefix(tuple(b + needs.companion(i) for i, b in enumerate(needs.layer_bytes)), budget - needs.fixed)
    return f"use --offload auto to stream layers (at most {k} of {len(needs.layer_bytes)} fit resident)"


def _check(need: int, budget: int, flag: str, what: str | Callable[[], str], hint: str | Callable[[], str]) -> None:
    """PlanError when `need` bytes exceed `budget`; what and hint may be callables (texts built only then)."""
    if need > budget:
        what, hint = (x() if callable(x) else x for x in (what, hint))
        raise PlanError(f"{flag} {gb_text(budget)} cannot hold {what}: {gb_text(need)} needed; raise {flag} to at least "
                        f"{gb_text(need)} or {hint}", flag, need, budget, what)


@dataclass(frozen=True)
class Budgets:
    """Default budgets of this machine: what is free now minus a safety margin (bytes; gpu None without CUDA)."""

    gpu: int | None
    ram: int
    notes: tuple[str, ...] = field(default=())


def default_budgets(device: str) -> Budgets:
    """Free GPU memory (torch.cuda.mem_get_info after emptying torch's cache) and available RAM (psutil), each
    minus a margin: 5% of the total and at least 512 MiB on the GPU, 10% of the total and at least 1 GiB in
    RAM. Call it before anything of the run is loaded: the plan counts every byte of the run itself."""
    import psutil

    vm = psutil.virtual_memory()
    ram = int(vm.available - max(0.10 * vm.total, 2**30))
    gpu = None
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()           # blocks the caching allocator holds but nothing uses count as free
        free, total = torch.cuda.mem_get_info(torch.device(device))
        gpu = int(free - max(0.05 * total, 2**29))
    return Budgets(gpu, max(ram, 0), ())
