"""How much disk a run will write besides its weights, known before the weights are here: the layer cache the
offload plan builds, estimated from config.json alone (shapes -> packed layer sizes -> the planner).

The estimate is specexec.planning.target.plan_target's own ledger planning (specexec.planning.ledger.plan_memory)
without the draft: the format is --quant, or for auto `none` while every layer stays resident and the device's streamed
format once any layer streams; a layer cache is built whenever the target is offloaded (a quantized format, or any
streamed layer). The draft is not counted in the plan (its size is not known before it is fetched), so the plan may
stream a little less than the real one; the cache is all layers either way.

Does not know: where weights come from (specexec.checkpoints.hub), how the cache is written (offload.cache.store).
"""
from __future__ import annotations

from pathlib import Path

import torch

from cpu_kernels.cache_root import default_cache_root
from offload.cache.store import SPACE_MARGIN
from offload.memory_plan import PlanError
from offload.planner import default_budgets

from specexec.config import EngineConfig, ModelArgs, OffloadConfig
from specexec.checkpoints.loading import read_args, resolve_dtype
from specexec.planning.ledger import ASSUMED, plan_memory
from specexec.planning.run_shape import run_shape
from specexec.planning.sizes import layer_sizes
from specexec.planning.target import target_formats


def layer_cache_bytes(args: ModelArgs, offload: OffloadConfig, engine: EngineConfig) -> int:
    """Bytes of the layer cache the plan would build for a target of `args` (0: everything stays resident
    and unquantized, or the budgets cannot hold the run at all, which loading reports)."""
    device = torch.device(engine.device)
    dtype = resolve_dtype(engine.dtype, device)
    budgets = default_budgets(device.type)
    gpu = offload.gpu_budget if offload.gpu_budget is not None else budgets.gpu
    ram = offload.ram_budget if offload.ram_budget is not None else budgets.ram
    shape = run_shape(args, None, engine, offload, device.type, dtype)
    try:
        memory = plan_memory(shape, target_formats(offload.quant, device.type), ram, gpu, offload.offload,
                             ASSUMED[device.type])
    except PlanError:
        return 0
    if memory.fmt == "none" and not memory.plan.streams:
        return 0
    return sum(layer_sizes(args, memory.fmt, dtype, device.type)) + SPACE_MARGIN


def reserve_for(offload: OffloadConfig, engine: EngineConfig):
    """A specexec.checkpoints.hub Reserve: snapshot dir (config.json fetched) -> [(layer cache root, bytes)]."""
    def reserve(snapshot: Path) -> list[tuple[Path, int]]:
        args = read_args(snapshot)
        root = Path(offload.cache_dir).expanduser() if offload.cache_dir else default_cache_root()
        return [(root, layer_cache_bytes(args, offload, engine))]
    return reserve
