"""Where `--budget auto`'s target pass costs are kept between runs: one JSON file per target fingerprint
(model shapes, dtype, device, offload plan, CPU threads, on a CPU the compiled kernels) under <cache root>/costs/
(specexec/tuning/store.py).

The runtime calls this module: `tuner_for` gives a new engine a BudgetTuner holding the saved costs (the
engine then skips its calibration passes), and `save_target_costs` keeps what an engine measured (the
engine hands it over through Engine.on_calibrated). The engine itself reads and writes no files.

Does not know: how passes are timed (the engine measures), the tuner's policy (specexec/tuning/budget.py).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from cpu_kernels.build import status as cpu_kernels_status
from specexec.abilities import has
from specexec.network.model import Transformer
from specexec.tuning.budget import BudgetTuner, CostModel, CurveFit
from specexec.tuning.store import store_path


@runtime_checkable
class PlannedLayers(Protocol):
    """A target whose layers live where a memory plan put them (an offloaded target: load_target sets it):
    `plan_fingerprint` names the tiers, slots and streamed KV, which its pass time depends on."""

    plan_fingerprint: str


def cost_fingerprint(target: Transformer) -> str:
    """What the target's pass time depends on: its shapes, dtype, device, (if offloaded) the plan and, on a CPU,
    which compiled kernels run (their library's name hashes their sources: new kernels, new costs)."""
    p = next(target.parameters())
    plan = target.plan_fingerprint if has(target, PlannedLayers) else ""
    kernels = cpu_kernels_status() if p.device.type == "cpu" else ""
    parts = [type(target).__name__, repr(target.args), str(p.dtype), str(p.device), str(plan),
             str(torch.get_num_threads()), kernels]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def default_cost_path(fingerprint: str) -> Path:
    """The cost file for one fingerprint."""
    return store_path("costs", fingerprint)


def saved_target_costs(target: Transformer) -> CurveFit | None:
    """The target pass costs measured earlier for this target on this machine (None: not yet, or stale)."""
    fingerprint = cost_fingerprint(target)
    saved = CostModel.load(default_cost_path(fingerprint), fingerprint)
    return saved.target if saved is not None else None


def save_target_costs(target: Transformer, curve: CurveFit) -> Path:
    """Keep measured target pass costs for the next run (written atomically); returns the file."""
    fingerprint = cost_fingerprint(target)
    path = default_cost_path(fingerprint)
    CostModel(curve).save(path, fingerprint)
    return path


def tuner_for(max_budget: int, target: Transformer) -> BudgetTuner:
    """A budget tuner up to max_budget, holding this target's saved pass costs when there are some."""
    tuner = BudgetTuner(max_budget)
    saved = saved_target_costs(target)
    if saved is not None:
        tuner.costs.target = saved
    return tuner
