"""A CPU plan's compute: on a CPU the pass is not hidden behind the copies; its layers compute on the same cores
that stream them. This prices it from the kernels measured on this very machine (specexec/tuning/cpu_rates.py,
kept by `specexec bench kernels`), or says that it cannot, and flags a plan that holds more RAM than the machine.

Does not know: how a rate is measured (cli/bench/components/kernels.py), the ledger's sizes (ledger.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from offload.memory_plan import GB, TIERS, gb_text
from specexec.planning.ledger import MemoryPlan
from specexec.tuning.cpu_rates import compute_seconds

HEAD_ITEM = "target norm/head"          # the ledger's line of the LM head (read by every pass)


@dataclass(frozen=True)
class CpuCompute:
    """One pass's compute on this CPU: the weight bytes it reads and, when this CPU's kernels for the format
    were measured, the seconds at the pass's rows (None: unknown)."""

    fmt: str
    rows: int
    weight_bytes: float
    seconds: float | None
    rate: float | None                  # bytes per second of the measured kernels at `rows`

    def pass_seconds(self, streaming_s: float) -> float | None:
        """The pass: streaming and compute overlap (the reader runs ahead of the layers computing), the longer
        one sets it; None while compute is unknown."""
        return None if self.seconds is None else max(streaming_s, self.seconds)

    def describe(self) -> str:
        what = f"{gb_text(self.weight_bytes)} of {self.fmt if self.fmt != 'none' else 'fp32'} weights"
        if self.seconds is None:
            return (f"compute not predicted: this CPU's {self.fmt} kernels were never measured here (`specexec "
                    f"bench kernels` measures them once; a pass reads {what})")
        rows = f"{self.rows} row{'s' if self.rows != 1 else ''}"
        return f"compute {self.seconds:.3f} s: {what} at {self.rate / GB:.2f} GB/s, this CPU's kernels as measured at {rows}"

    def to_json(self) -> dict:
        return {"format": self.fmt, "rows": self.rows, "weight_bytes": int(self.weight_bytes),
                "seconds": None if self.seconds is None else round(self.seconds, 4),
                "bytes_per_s": None if self.rate is None else round(self.rate)}


def cpu_compute(memory: MemoryPlan, threads: int) -> CpuCompute:
    """What one verification pass of the planned run reads and costs on this CPU (its tree's rows: the budget
    and the root with a draft, one row without)."""
    p, shape = memory.plan, memory.shape
    rows = shape.budget + 1 if shape.draft is not None or shape.self_draft is not None else 1
    weight_bytes = sum(p.pass_bytes(t) for t in TIERS) + memory.ledger().get(HEAD_ITEM, 0)
    priced = compute_seconds(weight_bytes, memory.fmt, rows, threads)
    seconds, rate = priced if priced is not None else (None, None)
    return CpuCompute(memory.fmt, rows, weight_bytes, seconds, rate)


def ram_warning(memory: MemoryPlan, total: int) -> str | None:
    """A line when the plan holds more RAM than the machine's `total` bytes (on a CPU everything held is RAM;
    with a GPU the host side), else None."""
    p = memory.plan
    held = p.host_bytes + (p.device_bytes if p.device == "cpu" else 0)
    if held <= total:
        return None
    return (f"this plan holds {gb_text(held)} of RAM and this machine has {gb_text(total)}: it would run out of "
            "memory here (lower --ram-budget, or plan knowingly for a larger machine)")
