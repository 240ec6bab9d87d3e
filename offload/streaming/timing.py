"""How a LayerPager times itself: on the device's clock, folded into counters only once the clock has run.

Every streamed layer gets a `LayerTiming`: copy start/end events (recorded on the pager's ONE copy stream on
CUDA, so copy spans never overlap) and compute start/end events (on the compute stream: start after it waited
for the copy, end when the consumer came back). A `PassTiming` holds a pass's start event and its layers.
On the CPU the same records hold `HostEvent`s (host-clock timestamps), so both devices share one fold.

`fold(stats, pass)` adds, per pass (all times on the device's clock):
  pass_s    pass start -> last layer's compute end (GPU time of the pass, not host time)
  compute_s sum of the layers' compute spans
  stall_s   per streamed layer, how long compute waited for its copy: from the previous layer's compute end to
            the copy's end when the copy ended later (capped at this layer's compute start)
  busy_s    time the copy stream spent moving this pass's layers inside the pass window (busy / pass_s is the
            copy engine's utilisation; bytes / pass_s is the effective rate)
  copy_s    per tier: time moving that tier's bytes (RAM: the copy; SSD: the copy when it is the disk read
            itself (CPU), else the host-timed disk reads the pager adds directly)
A pass is folded only when every event in it has completed (`ready()`: event.query(), no waiting), or when a
caller outside the step path asks to wait (`synchronize()`: waits on those events only, never device-wide).

Does not know: what is copied or from where (pager.py), tokens or models.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


class HostEvent:
    """torch.cuda.Event's interface on the host clock (CPU runs): record() stamps perf_counter."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t: float | None = None

    def record(self, stream: Any = None) -> "HostEvent":
        self.t = time.perf_counter()
        return self

    def query(self) -> bool:
        return self.t is not None

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: "HostEvent") -> float:
        """Milliseconds from this event to `end` (negative when `end` came first)."""
        return 1000.0 * (end.t - self.t)


@dataclass
class PagerStats:
    """Counters since the pager was made. Times in seconds; bytes per streaming tier ("ram", "ssd").
    bytes/layers/passes count on the host as layers are served; times come from folded passes."""

    bytes: dict[str, int] = field(default_factory=lambda: {"ram": 0, "ssd": 0})
    copy_s: dict[str, float] = field(default_factory=lambda: {"ram": 0.0, "ssd": 0.0})
    compute_s: float = 0.0
    stall_s: float = 0.0
    pass_s: float = 0.0
    busy_s: float = 0.0
    passes: int = 0
    layers: int = 0
    companion_bytes: int = 0    # bytes that travelled with streamed layers (a companion's, e.g. KV rows)
    folded: int = 0             # passes whose times are in (passes - folded are still on the device's clock)

    @property
    def streamed(self) -> int:
        """Bytes moved into slots: the layers' and their companions'."""
        return sum(self.bytes.values()) + self.companion_bytes

    def totals(self) -> dict[str, float]:
        """Flat cumulative counters (see LayerPager.counters)."""
        return {"bytes_streamed": self.streamed, "copy_s": sum(self.copy_s.values()), "stall_s": self.stall_s,
                "ram_bytes": self.bytes["ram"], "ssd_bytes": self.bytes["ssd"], "ram_copy_s": self.copy_s["ram"],
                "ssd_copy_s": self.copy_s["ssd"], "compute_s": self.compute_s, "pass_s": self.pass_s,
                "busy_s": self.busy_s, "passes": self.passes, "companion_bytes": self.companion_bytes}

    def summary(self) -> dict:
        return stream_summary({}, self.totals())


def stream_summary(before: dict[str, float], after: dict[str, float]) -> dict:
    """What happened between two `counters()` snapshots, JSON-able: bytes_streamed, passes, stall_ms,
    copy_ms, compute_ms, effective_gbps (bytes / GPU time of the passes), copy_busy (fraction of the passes'
    time the copy stream was moving their bytes) and per tier used: <tier>_bytes and <tier>_gbps (bytes / time
    spent moving that tier's bytes: the link's rate while busy)."""
    d = {k: v - before.get(k, 0) for k, v in after.items()}
    pass_s = d["pass_s"]
    out = {"bytes_streamed": int(d["bytes_streamed"]), "passes": int(d["passes"]),
           "stall_ms": round(1000 * d["stall_s"], 2), "copy_ms": round(1000 * d["copy_s"], 2),
           "compute_ms": round(1000 * d["compute_s"], 2),
           "effective_gbps": round(d["bytes_streamed"] / pass_s / 1e9, 3) if pass_s > 0 else None,
           "copy_busy": round(min(d.get("busy_s", 0.0) / pass_s, 1.0), 3) if pass_s > 0 else None}
    if d.get("companion_bytes"):
        out["companion_bytes"] = int(d["companion_bytes"])
    for tier in ("ram", "ssd"):
        if d[f"{tier}_bytes"]:
            out[f"{tier}_bytes"] = int(d[f"{tier}_bytes"])
            out[f"{tier}_gbps"] = round(d[f"{tier}_bytes"] / max(d[f"{tier}_copy_s"], 1e-9) / 1e9, 3)
    return out


@dataclass
class LayerTiming:
    """One served layer: its tier and events (copy_* None for a resident layer). count_copy: its copy span
    is the tier's copy time (False when the disk read, timed apart, is)."""

    tier: str
    copy_start: Any = None
    copy_end: Any = None
    compute_start: Any = None
    compute_end: Any = None
    count_copy: bool = True
    companion_bytes: int = 0            # bytes a companion moved with the layer (pager.py)

    def events(self) -> list[Any]:
        return [e for e in (self.copy_start, self.copy_end, self.compute_start, self.compute_end) if e is not None]


@dataclass
class PassTiming:
    """One pass: an event at its start (compute stream) and its layers in order."""

    start: Any
    layers: list[LayerTiming] = field(default_factory=list)

    def events(self) -> list[Any]:
        return [self.start] + [e for layer in self.layers for e in layer.events()]

    def ready(self) -> bool:
        """Every event has completed (cudaEventQuery: never blocks)."""
        return all(e.query() for e in reversed(self.events()))      # the latest first: usually decides

    def synchronize(self) -> None:
        """Wait for this pass's events (only these; outside the step path)."""
        for e in self.events():
            e.synchronize()


def fold(stats: PagerStats, p: PassTiming) -> None:
    """Add one finished pass's times to `stats` (see the module docstring)."""
    def t(ev: Any) -> float:                    # seconds since the pass started (negative: before it)
        return p.start.elapsed_time(ev) / 1000.0

    done = [layer for layer in p.layers if layer.compute_end is not None]
    end = max((t(layer.compute_end) for layer in done), default=0.0)
    prev = 0.0
    for layer in done:
        start, stop = t(layer.compute_start), t(layer.compute_end)
        stats.compute_s += max(stop - start, 0.0)
        if layer.copy_end is not None:
            c0, c1 = t(layer.copy_start), t(layer.copy_end)
            stats.stall_s += max(min(start, c1) - prev, 0.0)
            stats.busy_s += max(min(c1, end) - max(c0, 0.0), 0.0)
            if layer.count_copy:
                stats.copy_s[layer.tier] += max(c1 - c0, 0.0)
        prev = stop
    stats.pass_s += max(end, 0.0)
    stats.folded += 1
