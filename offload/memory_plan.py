"""What a memory plan is: its inputs (Needs: the sizes of what a run holds; Bandwidths: how fast each tier
streams; Parts: layers made of a dense region and sub-regions a pass reads only some of) and its result (Plan:
each decoder layer's tier, what every budget holds, how many sub-regions per layer a device cache keeps, the
predicted seconds per pass, and the ledger and text `specexec plan` prints). The names the --offload and
--kv-offload flags accept are registered here.

Does not know: how a plan is decided (planner.py), models, tokens, or how bytes move (streaming/).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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
class Parts:
    """Layers whose packed bytes are a dense region plus `count` sub-regions of `each` bytes (e.g. a mixture of
    experts' experts: storage.Region), of which one streamed pass reads only some. reads[c]: the sub-regions a
    pass is expected to read from one such layer when a device cache holds its c most often read ones (the
    caller's estimate; len count + 1, non-increasing, reads[count] = 0). `name` words the ledger ("expert")."""

    layers: tuple[int, ...]
    each: int
    count: int
    reads: tuple[float, ...]
    name: str = "part"

    def __post_init__(self) -> None:
        if len(self.reads) != self.count + 1:
            raise ValueError(f"Parts.reads needs {self.count + 1} entries (0 .. {self.count} cached), got "
                             f"{len(self.reads)}")

    def saved(self, cached: int) -> float:
        """Bytes one layer's pass does not read: the sub-regions it skips plus those the cache serves."""
        return (self.count - self.reads[min(cached, self.count)]) * self.each


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
    parts: layers whose passes read only some of their sub-regions (Parts), None when none do: a streamed
        one costs its dense region plus the sub-regions read, and device memory left over becomes a cache of
        the most often read sub-regions of each streamed one (Plan.cached_parts).
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
    parts: Parts | None = None

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
    cached_parts: int = 0                        # sub-regions (Needs.parts) the device cache keeps per streamed
                                                 # layer that has them

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

    def pass_bytes(self, tier: str) -> float:
        """Bytes one pass reads from a streaming tier: its layers' bytes, less (Needs.parts) the sub-regions a
        pass does not read or the device cache serves (expected)."""
        parts = self.needs.parts
        total = float(self.tier_bytes(tier))
        if parts is not None:
            total -= sum(1 for i in parts.layers if self.tiers[i] == tier) * parts.saved(self.cached_parts)
        return total

    @property
    def parts_streamed(self) -> int:
        """Streamed layers that have sub-regions (Needs.parts)."""
        parts = self.needs.parts
        return 0 if parts is None else sum(1 for i in parts.layers if self.tiers[i] != "resident")

    @property
    def part_cache_bytes(self) -> int:
        """Device bytes of the sub-region cache: cached_parts of each streamed layer that has them."""
        parts = self.needs.parts
        return 0 if parts is None else self.cached_parts * parts.each * self.parts_streamed

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
                + self.companion_bytes(False) + self.stage_bytes + self.part_cache_bytes)

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
        if self.part_cache_bytes:
            device[f"{self.needs.parts.name} cache"] = self.part_cache_bytes
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
        the copies; a companion's bytes are counted whole: its most, at the planned size; a layer with
        sub-regions (Needs.parts) only the ones a pass is expected to read)."""
        return ((self.pass_bytes("ram") + self.companion_bytes(True)) / self.bandwidths.ram
                + self.pass_bytes("ssd") / self.bandwidths.ssd)

    def summary(self) -> dict:
        """JSON-able counts and sizes (for stats lines and benchmarks)."""
        return {"device": self.device, "mode": self.mode,
                **{f"{t}_layers": len(self.layers_in(t)) for t in TIERS},
                **{f"{t}_bytes": self.tier_bytes(t) for t in TIERS},
                "device_bytes": self.device_bytes, "host_bytes": self.host_bytes,
                "slots": self.n_slots, "bounce_buffers": self.n_bounce,
                "streamed_companions": len(self.companions_streamed),
                "streamed_companion_bytes": self.companion_bytes(True),
                "cached_parts": self.cached_parts, "part_cache_bytes": self.part_cache_bytes,
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
        notes.setdefault("streaming slots", f"{self.n_slots} x {gb_text(self.slot_bytes)}" if self.streams else "")
        if self.part_cache_bytes:
            p = self.needs.parts
            notes.setdefault(f"{p.name} cache", f"the {self.cached_parts} most used of {p.count} {p.name}s of each "
                             f"of {self.parts_streamed} streamed layers ({gb_text(p.each)} each)")
        notes.setdefault("SSD bounce buffers", f"{self.n_bounce} x {gb_text(self.slot_bytes)}, read-ahead "
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
            lines.append(f"  {label} holds {gb_text(total)} of {gb_text(budget)} budget ({gb_text(budget - total)} left):")
            lines += [f"    {name:<26} {gb_text(b):>10}  {notes.get(name, '')}".rstrip()
                      for name, b in items.items() if b or name in notes]
        if ledger["ssd"]:
            lines.append(f"  SSD holds {gb_text(self.tier_bytes('ssd'))} (read every pass)")
        if self.streams:
            what = f"weights and {self.needs.companion_name}" if streamed else "weights"
            if self.parts_streamed:
                p = self.needs.parts
                what += (f" (of each streamed layer's {p.count} {p.name}s, {p.reads[min(self.cached_parts, p.count)]:.1f}"
                         f" expected to be read per pass)")
            lines.append(f"  expected {self.expected_s:.3f} s per pass streaming {what} (at RAM "
                         f"{self.bandwidths.ram / GB:.1f} GB/s, SSD {self.bandwidths.ssd / GB:.1f} GB/s)")
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def _span(ids: list[int]) -> str:
    """Layer ids as their runs, "[0..2]", "[1,4,8]", "[0..3,7..9]"; past four runs the first three, then the
    last: "[1,3,5,…,79]" (resident layers are spread among the streamed ones)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = [f"{a}..{b}" if b > a else f"{a}" for a, b in runs]
    return "[" + ",".join(text if len(text) <= 4 else text[:3] + ["…", text[-1]]) + "]"


def gb_text(n: float) -> str:
    """Bytes for messages and the ledger, always in GB, so every size of one message reads in one unit: 2
    decimals, more below 0.01 GB so a small size keeps 2 significant digits (1 kB: '0.0000010 GB', never
    '0.00 GB')."""
    gb = n / GB
    if gb == 0 or abs(gb) >= 0.01:
        return f"{gb:.2f} GB"
    decimals = min(12, 1 - math.floor(math.log10(abs(gb))))
    return f"{gb:.{decimals}f} GB"