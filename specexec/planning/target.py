"""Planning the target before anything loads: which formats --quant allows on the device (target_formats),
the run's memory plan from the configs and the budgets (plan_target), and what comes of it (TargetPlan: the
ledger, the tiers, and the layer naming the layer cache is built with).

Does not know: how the planned target is assembled or run (specexec/runtime/offloaded.py), how bytes move
(offload.streaming), the engine.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from offload.cache import store as layer_cache
from offload.cache.identity import LayerNames
from offload.memory_plan import PlanError
from offload.planner import default_budgets
from offload.platform.mounts import slow_mount_warnings
from offload.quant.weights import auto_format, device_problem

from specexec.checkpoints.naming import layer_names
from specexec.config import EngineConfig, ModelArgs, OffloadConfig
from specexec.options import ConfigError, check_budget_fits
from specexec.planning import ledger
from specexec.planning.expert_place import ExpertPlacement, place_experts
from specexec.planning.ledger import ASSUMED, MemoryPlan, plan_memory, what_fits
from specexec.planning.run_shape import DrafterSize, SelfDraftShape, run_shape


def target_formats(quant: str, device_type: str) -> tuple[str, ...]:
    """The formats plan_memory tries: --quant auto -> unquantized while every layer stays resident, else the
    device's streamed format (quant.auto_format: int4 on a CPU, nf4 on CUDA); any other --quant is the one
    format. ConfigError when that format cannot run on the device."""
    if quant == "auto":
        return ("none", auto_format(device_type))
    problem = device_problem(quant, device_type)
    if problem:
        raise ConfigError(f"--quant {quant}: {problem}")
    return (quant,)


class TargetPlan:
    """The run's memory plan (format, tiers, ledger: ledger.MemoryPlan) and the layer naming the cache is
    built with."""

    def __init__(self, memory: MemoryPlan, names: list[LayerNames], experts: ExpertPlacement | None = None) -> None:
        self.memory, self.names = memory, names
        self.fmt, self.plan = memory.fmt, memory.plan
        self.experts = experts                    # where streamed MoE layers' experts compute (None: dense)

    @property
    def cpu_expert_layers(self) -> tuple[int, ...]:
        return self.experts.cpu_layers if self.experts is not None else ()

    @property
    def offloaded(self) -> bool:
        """False when the plain resident loader serves (every layer resident, unquantized)."""
        return self.fmt != "none" or self.plan.streams

    def describe(self) -> str:
        lines = self.experts.lines() if self.experts is not None and self.plan.streams else []
        return "\n".join([self.memory.describe(), *lines])

    def notice(self) -> str:
        """What to print before loading: the ledger when anything is offloaded or the run is on a GPU, else
        only the plan's warnings."""
        if self.offloaded or self.plan.device == "cuda":
            return self.describe()
        return "\n".join(f"warning: {w}" for w in self.plan.warnings)


def plan_target(path: Path, args: ModelArgs, draft: ModelArgs | None, offload: OffloadConfig,
                engine: EngineConfig, device: torch.device, dtype: torch.dtype,
                draft_kv: Callable[[int], int] | None = None, self_draft: SelfDraftShape | None = None,
                drafter: DrafterSize | None = None) -> TargetPlan:
    """Plan the run from the configs (no weight is read; the checkpoint's tensor names and shapes are
    checked): layer format, each layer's tier, the ledger. `draft` is the draft's config (counted once, in
    --draft-quant's format), draft_kv its builder's kv_slots (None: no draft cache); self_draft: the draft is
    the target itself (with_self_draft; its layer count chosen here when auto). Budgets: --gpu-budget /
    --ram-budget, else what is free now (call this before anything of the run is loaded). ConfigError (one
    line, with what would fit) when the budgets cannot hold the run."""
    names = layer_names(path, args)
    _check_budgets_fit(offload, device)
    budgets = default_budgets(str(device))
    gpu = offload.gpu_budget if offload.gpu_budget is not None else budgets.gpu      # None on CPU unless given
    ram = offload.ram_budget if offload.ram_budget is not None else budgets.ram
    shape = run_shape(args, draft, engine, offload, device.type, dtype, draft_kv, self_draft, drafter)
    formats = target_formats(offload.quant, device.type)
    try:
        memory = plan_memory(shape, formats, ram, gpu, offload.offload, ASSUMED[device.type])
    except PlanError as e:
        hint = what_fits(shape, formats, ram, gpu, offload.offload, ASSUMED[device.type])
        raise ConfigError(str(e) + (f"; {hint}" if hint else "")) from None
    uses_cache = memory.fmt != "none" or memory.plan.streams
    root = (offload.cache_dir or layer_cache.default_cache_root()) if uses_cache else None
    try:
        experts = place_experts(memory.plan, args, offload.experts, shape.budget + 1)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return TargetPlan(ledger.with_warnings(memory, slow_mount_warnings(path, root)), names, experts)


def _check_budgets_fit(offload: OffloadConfig, device: torch.device) -> None:
    """Budgets above the machine's total RAM / the GPU's total memory are refused, not planned with."""
    import psutil

    check_budget_fits("--ram-budget", offload.ram_budget, psutil.virtual_memory().total, "RAM")
    if device.type == "cuda":                      # on CPU --gpu-budget is ignored (the plan warns)
        check_budget_fits("--gpu-budget", offload.gpu_budget, torch.cuda.mem_get_info(device)[1], "GPU memory")
