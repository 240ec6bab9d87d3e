"""The names --gate accepts (names only, no torch: configs check them while being built) and what each means
for a run.

auto: gate when the budget is automatic (--budget auto), never with a fixed --budget N (N then means N);
on: always gate; off: never gate. Gating: when the measured rates say the target alone is faster than
speculating, the engine stops drafting, probes now and then, and resumes when speculating pays again
(specexec/tuning/gate.py, specexec/pilot.py).

Does not know: how the gate decides (specexec/tuning/gate.py) or how a step runs.
"""
from __future__ import annotations

GATE_MODES = ("auto", "on", "off")


def gates(mode: str, auto_budget: bool) -> bool:
    """Whether a run with --gate `mode` gates drafting (auto: only with --budget auto)."""
    return mode == "on" or (mode == "auto" and auto_budget)
