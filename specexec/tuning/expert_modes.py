"""The values --experts accepts (names and parsing only, no torch: configs check them while being built).

stream: a streamed MoE layer copies the experts its rows were routed to onto the compute device (specexec/
runtime/expert_stream.py), the default. cpu[:N]: the expert FFNs of the streamed sparse layers held in RAM (all
of them, or the last N) are computed where they lie, on the CPU, with the CPU kernels; only hidden states cross
the link (specexec/runtime/cpu_experts.py). auto: per layer, whichever the planner prices lower
(specexec/planning/expert_place.py).

Does not know: what the modes do, which layers are streamed, costs.
"""
from __future__ import annotations

EXPERT_MODES = ("stream", "cpu", "auto")


def parse_experts(text: str) -> tuple[str, int | None]:
    """'stream' | 'cpu' | 'cpu:N' | 'auto' -> (mode, N or None: every eligible layer). ValueError (one line
    naming the value and what to write) for anything else."""
    raw = str(text).strip().lower()
    mode, sep, count = raw.partition(":")
    if mode not in EXPERT_MODES or (sep and mode != "cpu"):
        raise ValueError(f"unknown --experts {text!r}; choose one of: stream, cpu, cpu:N (N sparse layers), auto")
    if not sep:
        return mode, None
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"--experts {text!r}: N in cpu:N must be a whole number of sparse layers >= 1, e.g. cpu:8")
    return mode, int(count)
