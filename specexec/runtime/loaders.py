"""Each model of a run loaded on the configured device and dtype, with its load line (ModelInfo).

- `load_resident`: a whole checkpoint kept on the device (a draft model, or a target the plan keeps resident),
  its decoder linears optionally quantized; a CPU draft's int4/int8 layers as one compiled call each.
- `load_planned_target`: the target as its memory plan says (resident, or quantized and streamed:
  specexec/runtime/offloaded.py).
- `planned_self_draft` + `self_draft_info`: the self-draft over the plan's layers (specexec/runtime/self_draft.py).
- `load_chosen_drafter`: a drafter (EAGLE-3 head, MTP layer) over the loaded target (specexec/drafters/).

Does not know: which models a run has or in what order they load (specexec/runtime/assembly.py decides), how
the plan was made (it is handed one), tokenizers, the engine.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.quant.linear import QuantLinear, quantize_module

from specexec.checkpoints.loading import expected_shapes, load_model, resolve_dtype
from specexec.config import EngineConfig, ModelArgs, OffloadConfig
from specexec.drafters.choose import DrafterChoice, load_drafter
from specexec.network.drafter import Drafter
from specexec.network.model import Transformer
from specexec.planning.run_shape import MIN_SELF_LAYERS, SelfDraftShape, check_self_layers, spaced_layers
from specexec.planning.target import TargetPlan
from specexec.runtime.cpu_blocks import fuse_cpu_blocks
from specexec.runtime.offloaded import load_target, quantize_head, quantize_layers
from specexec.runtime.self_draft import SelfDraft, build_self_draft


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded, for the load summary."""

    path: Path
    args: ModelArgs
    params: int
    dtype: str
    device: str
    load_s: float

    def describe(self) -> dict:
        return {"path": str(self.path), "family": self.args.family, "layers": self.args.n_layers,
                "params": self.params, "dtype": self.dtype, "device": self.device,
                "load_s": round(self.load_s, 2)}


def _dtype_name(config: EngineConfig) -> tuple[torch.dtype, str]:
    """The run dtype on the configured device, and how a load line writes it ('float32')."""
    dtype = resolve_dtype(config.dtype, torch.device(config.device))
    return dtype, str(dtype).removeprefix("torch.")


def load_resident(path: Path, args: ModelArgs, config: EngineConfig, allow_pickle: bool,
                  quant: str = "none", draft: bool = False) -> tuple[Transformer, ModelInfo]:
    """A resident model on the configured device; its decoder linears quantized to `quant` (on CUDA block by
    block as they arrive, so the GPU never holds the unquantized model; freed blocks go back to the driver).
    A draft may use batch-dependent fused kernels (quant.kernel_for row_exact=False); a target never does. On a
    CPU an int4/int8 draft's layers run as one compiled call each (cpu_blocks; a target's get theirs from
    runtime/offloaded.py)."""
    t0 = time.perf_counter()
    device = torch.device(config.device)
    run_dtype, dtype = _dtype_name(config)
    if quant != "none" and device.type == "cuda":
        model = load_model(path, "cpu", dtype, allow_pickle)
        params = sum(p.numel() for p in model.parameters())
        for block in model.layers:
            quantize_module(block.to(device), quant, run_dtype, row_exact=not draft)
        model.to(device)
        torch.cuda.empty_cache()
    else:
        model = load_model(path, config.device, config.dtype, allow_pickle)
        params = sum(p.numel() for p in model.parameters())
        quantize_layers(model, quant, row_exact=not draft)
    quantize_head(model, quant, draft=draft)
    if draft:
        fuse_cpu_blocks(model)           # a CPU draft's int4/int8 layers as one compiled call each
    dtype += f" ({_formats(quant, model)})" if quant != "none" else ""
    return model, ModelInfo(path, args, params, dtype, config.device, time.perf_counter() - t0)


def _formats(layer_fmt: str, model: Transformer) -> str:
    """'int4 layers, int8 head' (what the load line and --json say a quantized model computes with)."""
    head = model._modules.get("lm_head")
    return f"{layer_fmt} layers" + (f", {head.fmt} head" if isinstance(head, QuantLinear) else "")


def load_planned_target(path: Path, args: ModelArgs, config: EngineConfig, offload: OffloadConfig,
                        target_plan: TargetPlan | None, allow_pickle: bool) -> tuple[Transformer, ModelInfo]:
    """The resident loader when every layer stays resident and unquantized, else the offloaded target."""
    if target_plan is None or not target_plan.offloaded:
        return load_resident(path, args, config, allow_pickle)
    t0 = time.perf_counter()
    dtype, dtype_name = _dtype_name(config)
    model = load_target(path, args, target_plan, offload, torch.device(config.device), dtype)
    params = sum(math.prod(s) for s in expected_shapes(args).values())
    name = f"{dtype_name} ({_formats(target_plan.fmt, model)})"
    return model, ModelInfo(path, args, params, name, config.device, time.perf_counter() - t0)


def planned_self_draft(target: Transformer, path: Path, spec: SelfDraftShape, target_plan: TargetPlan | None,
                       offload: OffloadConfig, say: Callable[[str], None]) -> SelfDraft:
    """The self-draft over the planned layers (unplanned, i.e. a resident pickle target: --draft-layers N, or
    half its layers), sharing what the target holds resident, copies of the rest."""
    n = target.args.n_layers
    if target_plan is not None:
        ids = target_plan.memory.draft_layers
    else:
        if spec.layers is not None:
            check_self_layers(spec.layers, n)
        ids = spaced_layers(n, spec.layers or max(min(MIN_SELF_LAYERS, n), n // 2))
    names = target_plan.names if target_plan is not None else None
    say(f"building the self-draft ({len(ids)} of {n} layers)")
    return build_self_draft(target, ids, spec.fmt, path, names, offload.cache_dir, say)


def self_draft_info(draft: SelfDraft, path: Path, config: EngineConfig, t0: float) -> ModelInfo:
    """The load line of a self-draft built (and its depth chosen) since perf_counter() read `t0`."""
    params = sum(math.prod(s) for s in expected_shapes(draft.args).values())
    return ModelInfo(path, draft.args, params, f"{_dtype_name(config)[1]} ({draft.describe()})", config.device,
                     time.perf_counter() - t0)


def load_chosen_drafter(choice: DrafterChoice, target: Transformer, t_args: ModelArgs, config: EngineConfig
                        ) -> tuple[Drafter, ModelInfo]:
    """The chosen drafter for the loaded target (from the layout its choice checked: its checkpoint is open
    already), and its load line (its context is the target's: RoPE is relative, so a head trained on shorter
    sequences still runs)."""
    t0 = time.perf_counter()
    dtype, dtype_name = _dtype_name(config)
    model, params = load_drafter(choice, target, dtype, torch.device(config.device))
    return model, ModelInfo(choice.path, choice.plan_args(t_args), params, f"{dtype_name} ({choice.kind})",
                            config.device, time.perf_counter() - t0)
