"""How much disk a run will write besides its weights, known before the weights are here: the layer cache the
offload plan builds, estimated from config.json alone (shapes -> packed layer sizes -> the planner).

The estimate follows specexec.offloaded.plan_target: the format is --quant, or for auto `none` while every layer
stays resident and nf4 once any layer streams; a layer cache is built whenever the target is offloaded (a
quantized format, or any streamed layer). The draft is not counted in the plan (its size is not known before
it is fetched), so the plan may stream a little less than the real one; the cache is all layers either way.

Does not know: where weights come from (specexec.hub), how the cache is written (offload.cache).
"""
from __future__ import annotations

from pathlib import Path

import torch

from offload import quant, storage
from offload.cache import SPACE_MARGIN, default_cache_root
from offload.planner import PlanError, default_budgets, plan

from .config import EngineConfig, ModelArgs, OffloadConfig
from .loading import read_args, resolve_dtype
from .model import Block
from .offloaded import ASSUMED, block_tensor_names, target_needs


def layer_bytes(args: ModelArgs, fmt: str, dtype: torch.dtype) -> int:
    """Packed bytes of one decoder layer of `args` in format `fmt` (from shapes alone)."""
    names, linear = block_tensor_names(args)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in Block(args).state_dict().items()}
    specs, meta = quant.layer_specs({n: (dtype, shapes[n]) for n in names}, fmt, dtype, linear)
    return storage.plan_layout(specs, meta).nbytes


def layer_cache_bytes(args: ModelArgs, offload: OffloadConfig, engine: EngineConfig) -> int:
    """Bytes of the layer cache the plan would build for a target of `args` (0: everything stays resident
    and unquantized, or the budgets cannot hold the run at all, which loading reports)."""
    device = torch.device(engine.device)
    dtype = resolve_dtype(engine.dtype, device)
    budgets = default_budgets(device.type)
    gpu = offload.gpu_budget if offload.gpu_budget is not None else budgets.gpu
    ram = offload.ram_budget if offload.ram_budget is not None else budgets.ram
    elem = torch.empty((), dtype=dtype).element_size()
    candidates = ["none", "nf4"] if offload.quant == "auto" else [offload.quant]
    for k, fmt in enumerate(candidates):
        size = layer_bytes(args, fmt, dtype)
        needs = target_needs(args, [size] * args.n_layers, None, engine, elem, fmt)
        try:
            chosen = plan(needs, device.type, ram, gpu, offload.offload, ASSUMED[device.type])
        except PlanError:
            continue
        if fmt == "none" and k + 1 < len(candidates) and chosen.streams:
            continue
        return size * args.n_layers + SPACE_MARGIN if (fmt != "none" or chosen.streams) else 0
    return 0


def reserve_for(offload: OffloadConfig, engine: EngineConfig):
    """A specexec.hub Reserve: snapshot dir (config.json fetched) -> [(layer cache root, bytes)]."""
    def reserve(snapshot: Path) -> list[tuple[Path, int]]:
        args = read_args(snapshot)
        root = Path(offload.cache_dir).expanduser() if offload.cache_dir else default_cache_root()
        return [(root, layer_cache_bytes(args, offload, engine))]
    return reserve
