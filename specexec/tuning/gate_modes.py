"""The names --gate accepts (names only, no torch: configs check them while being built) and what each means
for a run.

auto: gate when the budget is automatic (--budget auto), never with a fixed --budget N (N then means N);
on: always gate; off: never gate. Gating: when the measured rates say the target alone is faster than
speculating, the engine stops drafting, probes now and then, and resumes when speculating pays again
(specexec/tuning/gate.py, specexec/pilot.py).

A self-draft whose depth was measured (--draft-layers auto, specexec/runtime/depth_probe.py) and of which no
depth is predicted to beat the target alone gates even with a fixed --budget N under --gate auto
(`with_depth_verdict`): drafting then stops as soon as the gate measures the same. --gate off stays off.

Does not know: how the gate decides (specexec/tuning/gate.py) or how a step runs.
"""
from __future__ import annotations

GATE_MODES = ("auto", "on", "off")


def gates(mode: str, auto_budget: bool) -> bool:
    """Whether a run with --gate `mode` gates drafting (auto: only with --budget auto)."""
    return mode == "on" or (mode == "auto" and auto_budget)


def with_depth_verdict(mode: str, drafting_loses: bool) -> str:
    """The --gate mode of a run once the self-draft's depth was chosen: auto becomes on when even the best
    depth is predicted to lose to the target alone (the gate then turns drafting off as it measures), else
    `mode` unchanged."""
    return "on" if mode == "auto" and drafting_loses else mode
