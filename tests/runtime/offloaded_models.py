"""The offloaded target as the tests build it (a helper of tests/runtime/test_offloaded.py and tests/network/
test_moe.py): the layer cache of a tiny checkpoint, the resident model quantized alike, and the same model
assembled over given tiers.
"""
from __future__ import annotations

from pathlib import Path

import torch

from offload.cache.store import LayerCache
from offload.quant.linear import quantize_module
from offload.quant.weights import head_format
from specexec.checkpoints.loading import load_model, read_args
from specexec.checkpoints.naming import layer_names
from specexec.network.model import Execution
from specexec.runtime.cpu_blocks import fuse_cpu_blocks
from specexec.runtime.offloaded import OffloadedTransformer, build_offloaded

CPU = torch.device("cpu")


def open_cache(path: Path, fmt: str, root: Path) -> LayerCache:
    return LayerCache.open_or_build(path, layer_names(path, read_args(path)), fmt, torch.float32, cache_root=root,
                                    progress=False)


def reference(path: Path, fmt: str) -> torch.nn.Module:
    """The resident model with every decoder layer quantized the same way (QuantLinear owning its weights), its
    layers computed as an offloaded target's are (the compiled layers of the CPU integer kernels: cpu_blocks)."""
    model = load_model(path)
    for block in model.layers:
        quantize_module(block, fmt, torch.float32)
    exact = head_format(fmt, "cpu") == "int8"                           # as build_offloaded's
    model.run_as(Execution(row_exact=exact))
    for block in model.layers:                                           # and its routers (moe.Router._logits)
        block.run_as(None, exact)
    if exact:
        fuse_cpu_blocks(model)
    return model


def offloaded(path: Path, fmt: str, tiers: list[str], root: Path, expert_cache: int = 0) -> OffloadedTransformer:
    """expert_cache: experts of each streamed MoE layer the device cache keeps (specexec/runtime/expert_stream)."""
    return build_offloaded(path, read_args(path), open_cache(path, fmt, root), tiers, CPU, torch.float32,
                           expert_cache=expert_cache)
