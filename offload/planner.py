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

Read-ahead depth (how many layers the SSD reader may hold ahead of the consumer: pinned bounce buffers on
CUDA, host slots on CPU) starts at the minimum the Needs give (2) and grows into whatever budget is LEFT once
every layer has its tier, up to MAX_READ_AHEAD and the number of SSD layers. It never displaces a layer: a
layer kept resident (or in the RAM tier) saves its read on every pass, a deeper read-ahead at most the reads
that fit in the drafting time, so a layer is always worth at least as much as a buffer of its size. With
--offload ssd (nothing else competes for RAM) the read-ahead is as deep as the cap allows.

`Plan.ledger()` names every byte each budget holds (the device side, the host side, the disk); `describe()`
prints it with the predicted seconds per pass.

Does not know: models, tokens, how bytes move (tiers.py/pager.py), or where the sizes came from.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

TIERS = ("resident", "ram", "ssd")
MAX_READ_AHEAD = 8              # most buffers the SSD reader fills ahead (bounce buffers on CUDA, slots on CPU)
OFFLOAD_MODES = ("auto", "none", "ram", "ssd")
COMPANION_MODES = ("auto", "device", "stream")
COMPANION_GAIN = 0.02           # auto streams companions only to fit, or to save at least this share of a pass
GB = 1e9


class PlanError(ValueError):
    """Budgets that cannot hold the run; the message is one line saying what would fit. `flag`, `needed`,
    `budget` and `what` say which budget fell short, by how much, holding what (None when the error is not
    about a budget)."""

    def __init__(self, message: str, flag: str | None = None, needed: int | None = None,
                 budget: int | None = None, what: str | None = None) -> None:
        super().__init__(message)
        self.flag, self.needed, self.budget, self.what = flag, needed, budget, what


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second of each streaming tier into a device slot, as the caller assumes or was told them.

    ram: host region -> slot (pinned H2D over PCIe on CUDA; a memcpy on CPU).
    ssd: the disk read (the bounce -> device hop overlaps with it and is bounded by `ram`)."""

    ram: float = 20e9
    ssd: float = 2e9


@dataclass(frozen=True)
class Needs:
    """Sizes in bytes of what one run holds.

    layer_bytes: packed size of each target decoder layer (as stored in the tiers).
    fixed_bytes: the device-side (GPU, or RAM on CPU) costs that do not depend on the plan, by name
        (e.g. {"target norm/head": .., "draft weights": .., "target KV cache": .., "activations": ..}).
    n_slots: device slots streamed layers go through; n_bounce: host bounce buffers for the SSD reader (CUDA):
        the minimum; the plan deepens the read-ahead into budget left over (see the module docstring).
    host_fixed: host-RAM costs of a CUDA run besides the streaming tiers, by name (e.g. the input embedding
        kept in RAM); on CPU everything is in `fixed_bytes`.
    notes: name -> a short detail printed beside that ledger line (sizes in slots, formats, ...).
    max_read_ahead: cap of the read-ahead depth.
    companion_bytes: per layer, the bytes of its companion (empty: none); companion_residue: per layer, the
        device bytes a streamed companion still keeps there; companion_name names them in the ledger;
        companions: "auto" (the planner decides), "device" (never streamed) or "stream" (every streamed
        layer's companion streams)."""

    layer_bytes: tuple[int, ...]
    fixed_bytes: tuple[tuple[str, int], ...] = ()
    n_slots: int = 2
    n_bounce: int = 2
    host_fixed: tuple[tuple[str, int], ...] = ()
    notes: tuple[tuple[str, str], ...] = ()
    max_read_ahead: int = MAX_READ_AHEAD
    companion_bytes: tuple[int, ...] = ()
    companion_residue: tuple[int, ...] = ()
    companion_name: str = "companions"
    companions: str = "auto"

    def companion(self, i: int) -> int:
        return self.companion_bytes[i] if self.companion_bytes else 0

    def residue(self, i: int) -> int:
        return self.companion_residue[i] if self.companion_residue else 0

    @property
    def fixed(self) -> int:
        return sum(b for _, b in self.fixed_bytes)

    @property
    def host(self) -> int:
        return sum(b for _, b in self.host_fixed)

    @property
    def max_layer(self) -> int:
        return max(self.layer_bytes, default=0)


@dataclass(frozen=True)
class Plan:
    """Each layer's tier and what every budget holds. `describe()` is the text printed before generation."""

    device: str                                  # "cuda" or "cpu"
    tiers: tuple[str, ...]                       # one of TIERS per decoder layer
    needs: Needs
    gpu_budget: int | None                       # None on CPU
    ram_budget: int
    bandwidths: Bandwidths = Bandwidths()
    warnings: tuple[str, ...] = ()
    mode: str = "auto"
    slots: int = 0                               # device slots (0: the Needs' minimum)
    bounce: int = 0                              # SSD bounce buffers on CUDA (0: the Needs' minimum)
    streamed_companions: tuple[bool, ...] = ()   # per layer: its companion lives in RAM and streams with it

    def layers_in(self, tier: str) -> list[int]:
        return [i for i, t in enumerate(self.tiers) if t == tier]

    @property
    def companions_streamed(self) -> list[int]:
        """Layers whose companion travels with them from host RAM."""
        return [i for i, s in enumerate(self.streamed_companions) if s]

    def companion_bytes(self, streamed: bool) -> int:
        """Bytes of the companions that stream (True: in host RAM) or stay on the device (False)."""
        flags = self.streamed_companions or (False,) * len(self.tiers)
        return sum(self.needs.companion(i) for i, s in enumerate(flags) if s == streamed)

    @property
    def stage_bytes(self) -> int:
        """Device memory of streamed companions: a stage per slot (the largest one) plus their residues."""
        ids = self.companions_streamed
        return self.n_slots * max((self.needs.companion(i) for i in ids), default=0) + \
            sum(self.needs.residue(i) for i in ids)

    def tier_bytes(self, tier: str) -> int:
        return sum(b for b, t in zip(self.needs.layer_bytes, self.tiers) if t == tier)

    @property
    def streams(self) -> bool:
        return any(t != "resident" for t in self.tiers)

    @property
    def slot_bytes(self) -> int:
        """Size of one streaming slot: the largest streamed layer (0 when nothing streams)."""
        return max((b for b, t in zip(self.needs.layer_bytes, self.tiers) if t != "resident"), default=0)

    @property
    def n_slots(self) -> int:
        """Device slots streamed layers pass through (on CPU: the host slots the SSD reader fills)."""
        return (self.slots or self.needs.n_slots) if self.streams else 0

    @property
    def n_bounce(self) -> int:
        """Host bounce buffers for the SSD reader (CUDA only: on CPU the reader fills the slots directly)."""
        return (self.bounce or self.needs.n_bounce) if self.device == "cuda" and "ssd" in self.tiers else 0

    @property
    def read_ahead(self) -> int:
        """Layers the SSD reader may hold ahead of the consumer: bounce buffers on CUDA, slots on CPU."""
        return self.n_bounce if self.device == "cuda" else self.n_slots if "ssd" in self.tiers else 0

    @property
    def device_bytes(self) -> int:
        """Held on the device (GPU; on CPU: everything in memory except the RAM tier's region)."""
        return (self.needs.fixed + self.tier_bytes("resident") + self.n_slots * self.slot_bytes
                + self.companion_bytes(False) + self.stage_bytes)

    @property
    def host_bytes(self) -> int:
        """Held in host RAM besides the device side: host fixed costs, the RAM tier's region, bounce buffers,
        streamed companions."""
        return self.needs.host + self.tier_bytes("ram") + self.n_bounce * self.slot_bytes + self.companion_bytes(True)

    @property
    def device_budget(self) -> int:
        return self.gpu_budget if self.device == "cuda" else self.ram_budget

    def ledger(self) -> dict[str, dict[str, int]]:
        """Every byte each budget holds, by tier and item: {"device": {...}, "host": {...}, "ssd": {...}}.
        "device" is the GPU on CUDA and RAM on CPU; the items of each tier sum to device_bytes / host_bytes."""
        n = {t: len(self.layers_in(t)) for t in TIERS}
        device = {name: b for name, b in self.needs.fixed_bytes}
        device["resident target layers"] = self.tier_bytes("resident")
        device["streaming slots"] = self.n_slots * self.slot_bytes
        host = {name: b for name, b in self.needs.host_fixed}
        if self.needs.companion_bytes:
            device[self.needs.companion_name] = self.companion_bytes(False)
        if self.companions_streamed:
            device[f"{self.needs.companion_name} stages"] = self.stage_bytes
            host[f"{self.needs.companion_name} (streamed)"] = self.companion_bytes(True)
        if n["ram"]:
            host["RAM tier layers"] = self.tier_bytes("ram")
        if self.n_bounce:
            host["SSD bounce buffers"] = self.n_bounce * self.slot_bytes
        return {"device": device, "host": host, "ssd": {"SSD tier layers": self.tier_bytes("ssd")} if n["ssd"] else {}}

    @property
    def expected_s(self) -> float:
        """Seconds one pass spends streaming weights and streamed companions (compute assumed hidden behind
        the copies; a companion's bytes are counted whole: its most, at the planned size)."""
        return ((self.tier_bytes("ram") + self.companion_bytes(True)) / self.bandwidths.ram
                + self.tier_bytes("ssd") / self.bandwidths.ssd)

    def summary(self) -> dict:
        """JSON-able counts and sizes (for stats lines and benchmarks)."""
        return {"device": self.device, "mode": self.mode,
                **{f"{t}_layers": len(self.layers_in(t)) for t in TIERS},
                **{f"{t}_bytes": self.tier_bytes(t) for t in TIERS},
                "device_bytes": self.device_bytes, "host_bytes": self.host_bytes,
                "slots": self.n_slots, "bounce_buffers": self.n_bounce,
                "streamed_companions": len(self.companions_streamed),
                "streamed_companion_bytes": self.companion_bytes(True),
                "expected_s_per_pass": round(self.expected_s, 4)}

    def describe(self) -> str:
        """The ledger as text: every item each budget holds (with the layers of each tier), the totals against
        the budgets, and the expected seconds per pass."""
        where = "GPU" if self.device == "cuda" else "RAM"
        notes = dict(self.needs.notes)
        ledger = self.ledger()
        lines = [f"offload plan ({self.mode}, {len(self.tiers)} target layers, device {self.device}):"]
        names = {"resident": f"resident ({where})", "ram": "RAM tier" + (" (pinned)" if self.device == "cuda" else ""),
                 "ssd": "SSD tier"}
        for t in TIERS:
            ids = self.layers_in(t)
            if ids:
                lines.append(f"  {names[t]:<18} {len(ids):>4} layers {_span(ids):<12} "
                             f"{self.tier_bytes(t) / GB:8.2f} GB")
        streamed = self.companions_streamed
        if streamed:
            lines.append(f"  {self.needs.companion_name} streamed with {len(streamed)} layers {_span(streamed)}, "
                         f"{self.companion_bytes(True) / GB:.2f} GB in RAM; on the device for "
                         f"{len(self.tiers) - len(streamed)} layers")
        notes.setdefault("streaming slots", f"{self.n_slots} x {_gb(self.slot_bytes)}" if self.streams else "")
        notes.setdefault("SSD bounce buffers", f"{self.n_bounce} x {_gb(self.slot_bytes)}, read-ahead "
                         f"{self.read_ahead} layers")
        if self.device == "cpu" and "ssd" in self.tiers:
            notes["streaming slots"] += f", read-ahead {self.read_ahead} layers"
        if self.device == "cuda":
            rows = [("GPU", ledger["device"], self.device_bytes, self.device_budget),
                    ("RAM", ledger["host"], self.host_bytes, self.ram_budget)]
        else:                                    # one budget: the device side and the RAM tier are both RAM
            rows = [("RAM", {**ledger["device"], **ledger["host"]}, self.device_bytes + self.host_bytes,
                     self.ram_budget)]
        for label, items, total, budget in rows:
            lines.append(f"  {label} holds {_gb(total)} of {_gb(budget)} budget ({_gb(budget - total)} left):")
            lines += [f"    {name:<26} {_gb(b):>10}  {notes.get(name, '')}".rstrip()
                      for name, b in items.items() if b or name in notes]
        if ledger["ssd"]:
            lines.append(f"  SSD holds {_gb(self.tier_bytes('ssd'))} (read every pass)")
        if self.streams:
            what = f"weights and {self.needs.companion_name}" if streamed else "weights"
            lines.append(f"  expected {self.expected_s:.3f} s per pass streaming {what} (at RAM "
                         f"{self.bandwidths.ram / GB:.1f} GB/s, SSD {self.bandwidths.ssd / GB:.1f} GB/s)")
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _span(ids: list[int]) -> str:
    return f"[{ids[0]}..{ids[-1]}]" if len(ids) > 1 else f"[{ids[0]}]"


def _gb(n: float) -> str:
    """Bytes for messages: GB with 2 decimals; below 10 MB in MB/kB/B (else a small budget reads '0.00 GB')."""
    if abs(n) >= 0.01 * GB:
        return f"{n / GB:.2f} GB"
    return f"{n / 1e6:.2f} MB" if abs(n) >= 1e6 else f"{n / 1e3:.1f} kB" if abs(n) >= 1e3 else f"{int(n)} B"


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
        tiers, companions = _assign_cuda(needs, gpu_budget, ram_budget, mode, bandwidths)
    else:
        tiers, companions = _assign_cpu(needs, ram_budget, mode)
    base = Plan(device, tiers, needs, gpu_budget, ram_budget, bandwidths, warnings, mode,
                streamed_companions=companions)
    return _deepen_read_ahead(base)


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
        _check(whole, gpu, "--gpu-budget", _fixed_text(needs, whole - needs.fixed - sum(sizes))
               + f" and all {n} target layers resident "
               f"({_gb(sum(sizes))})", _resident_hint(needs, gpu))
        return ("resident",) * n, (False,) * n
    best, plain, error = None, None, None
    for k in (range(n - 1, -1, -1) if mode == "auto" else (0,)):
        try:
            cand = _candidate(needs, k, gpu, ram, mode, bw)
        except PlanError as e:
            error = (error or e) if k else e                  # k = 0 needs the least GPU: its error says most
            continue
        if best is None or cand[2] < best[2] - 1e-12:         # a tie keeps more resident layers
            best = cand
        if not any(cand[1]) and (plain is None or cand[2] < plain[2] - 1e-12):
            plain = cand
    if best is None:
        raise error
    if plain is not None and best[2] >= (1 - COMPANION_GAIN) * plain[2]:
        best = plain                                          # streaming companions must pay for itself
    return best[0], best[1]


def _candidate(needs: Needs, k: int, gpu: int, ram: int, mode: str, bw: Bandwidths
               ) -> tuple[tuple[str, ...], tuple[bool, ...], float]:
    """The first k layers resident (with their companions), the rest streamed: as many of their companions
    on the device as the GPU budget leaves room for (by the companion mode), the others in RAM; streamed
    layers in RAM, then on the SSD. (tiers, companions streamed, expected seconds per pass); PlanError when
    a budget cannot hold it."""
    n, sizes = len(needs.layer_bytes), needs.layer_bytes
    rest = range(k, n)
    slots = needs.n_slots * needs.max_layer
    base = needs.fixed + sum(sizes[i] + needs.companion(i) for i in range(k)) + slots
    stage = needs.n_slots * max((needs.companion(i) for i in rest), default=0) + sum(needs.residue(i) for i in rest)
    on_device = sum(needs.companion(i) for i in range(k)) + (sum(needs.companion(i) for i in rest)
                                                             if needs.companions == "device" else stage)
    floor = base - sum(needs.companion(i) for i in range(k)) + on_device
    what = "" if needs.companions == "device" or k else " stages"
    _check(floor, gpu, "--gpu-budget", _fixed_text(needs, on_device, what)
           + f" and {needs.n_slots} streaming slots ({_gb(slots)})"
           + (f" and {k} resident layers" if k else ""), "lower --budget (smaller trees need less activation "
           "memory), a shorter --context, or use a smaller draft")
    keep = _device_companions(needs, k, gpu - base, stage)
    companions = (False,) * (k + keep) + (True,) * (n - k - keep)
    streamed_c = sum(needs.companion(i) for i in range(k + keep, n))
    if mode in ("ram", "ssd"):
        tiers = (mode,) * n
    else:
        tiers = ("resident",) * k + _ram_then_ssd(sizes[k:], ram - needs.host - streamed_c,
                                                  needs.n_bounce * needs.max_layer)
    bounce = needs.n_bounce * needs.max_layer if "ssd" in tiers else 0
    in_ram = sum(b for b, t in zip(sizes, tiers) if t == "ram")
    parts = [f"{name} ({_gb(b)})" for name, b in needs.host_fixed if b]
    parts += [f"{needs.companion_name} of {n - k - keep} layers ({_gb(streamed_c)})"] if streamed_c else []
    parts += [f"{tiers.count('ram')} pinned layers"] if "ram" in tiers else []
    parts += [f"{needs.n_bounce} SSD bounce buffers ({_gb(bounce)})"] if bounce else []
    _check(needs.host + streamed_c + in_ram + bounce, ram, "--ram-budget", " and ".join(parts),
           "use --offload ssd or auto to stream from disk instead" if mode == "ram" else "free some RAM")
    ssd = sum(b for b, t in zip(sizes, tiers) if t == "ssd")
    return tiers, companions, (in_ram + streamed_c) / bw.ram + ssd / bw.ssd


def _device_companions(needs: Needs, k: int, room: int, stage: int) -> int:
    """How many of the streamed layers' companions (from layer k on, in order) stay on the device in `room`
    bytes: all when they fit (or the mode says device), none when the mode says stream, else as many as fit
    beside the stages and the residues of the others."""
    n = len(needs.layer_bytes)
    if needs.companions == "device" or (needs.companions == "auto" and
                                        sum(needs.companion(i) for i in range(k, n)) <= room):
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
               f"layers ({_gb(sum(sizes))})", _resident_hint(needs, ram))
        return ("resident",) * n, (False,) * n
    stream = needs.companions == "stream" and comp > 0
    stage = needs.n_slots * max(needs.companion_bytes) + sum(needs.residue(i) for i in range(n)) if stream else 0
    slots = needs.n_slots * needs.max_layer + stage
    fixed = needs.fixed + comp
    if mode == "ram":
        _check(fixed + slots + sum(sizes), ram, "--ram-budget", _fixed_text(needs, comp) + f", {needs.n_slots} "
               f"slots ({_gb(slots)}) and a RAM tier of all {n} layers ({_gb(sum(sizes))})",
               "use --offload ssd or auto to stream from disk instead")
        tiers = ("ram",) * n
    else:
        _check(fixed + slots, ram, "--ram-budget", _fixed_text(needs, comp) + f" and {needs.n_slots} streaming slots "
               f"({_gb(slots)})", "lower --budget or use a smaller draft")
        k = 0 if mode == "ssd" else _fit_prefix(sizes, ram - fixed - slots)
        tiers = ("resident",) * k + ("ssd",) * (n - k)
    return tiers, tuple(stream and t != "resident" for t in tiers)


def _ram_then_ssd(sizes: tuple[int, ...], ram: int, bounce: int) -> tuple[str, ...]:
    """Streamed layers: as many as fit in RAM go there; the rest on the SSD (which then needs bounce buffers)."""
    k = _fit_prefix(sizes, ram)
    if k == len(sizes):
        return ("ram",) * k
    k = _fit_prefix(sizes, ram - bounce)
    return ("ram",) * k + ("ssd",) * (len(sizes) - k)


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
    parts = [f"{name} ({_gb(b)})" for name, b in needs.fixed_bytes if b]
    if companions:
        parts.append(f"{needs.companion_name}{what} ({_gb(companions)})")
    return ", ".join(parts) if parts else "nothing fixed"


def _resident_hint(needs: Needs, budget: int) -> str:
    k = _fit_prefix(tuple(b + needs.companion(i) for i, b in enumerate(needs.layer_bytes)), budget - needs.fixed)
    return f"use --offload auto to stream layers (at most {k} of {len(needs.layer_bytes)} fit resident)"


def _check(need: int, budget: int, flag: str, what: str, hint: str) -> None:
    if need > budget:
        raise PlanError(f"{flag} {_gb(budget)} cannot hold {what}: {_gb(need)} needed; raise {flag} to at least "
                        f"{_gb(need)} or {hint}", flag, need, budget, what)


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
