"""What a layer cache's build will write and read, from the checkpoint's headers alone (nothing is read or
quantized): every layer's packed layout (`plan`: the planner's sizes, the build's check of what it packed, the
disk-space check) and the bytes each layer reads from the checkpoint (`source_nbytes`: the build's progress in MB/s).

Does not know: quantizing, files of the cache, locks.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from offload.cache.identity import LayerNames, source_specs
from offload.cache.manifest import CacheError
from offload.formats.checkpoint import CheckpointError
from offload.formats.refs import ref_shape
from offload.quant.weights import layer_specs
from offload.streaming.storage import LayerLayout, plan_layout


def plan(checkpoint_dir: Path, layers: Sequence[LayerNames], fmt: str, dtype: torch.dtype, double_quant: bool,
         device: str | torch.device | None = None) -> list[LayerLayout]:
    """Every layer's packed layout when quantized on `device` (default CPU), from the safetensors headers alone
    (nothing is read or quantized)."""
    src = source_specs(checkpoint_dir)
    layouts = []
    for i, s in enumerate(layers):
        refs = s.refs()
        missing = [r.name for r in refs.values() if r.name not in src]
        if missing:
            raise CacheError(f"{checkpoint_dir}: layer {i} needs tensor {missing[0]!r}, which no weight file has")
        try:
            shapes = {p: (src[r.name][0], ref_shape(r, src[r.name][1])) for p, r in refs.items()}
        except CheckpointError as e:
            raise CacheError(f"{checkpoint_dir}: {e}") from None
        specs, meta = layer_specs(shapes, fmt, dtype, s.linear, double_quant, device or "cpu")
        layouts.append(plan_layout(specs, meta, s.regions))
    return layouts


def source_nbytes(checkpoint_dir: Path, layers: Sequence[LayerNames]) -> list[int]:
    """Bytes each layer reads from the checkpoint (its tensors as stored, dense: a GGUF's as its reader returns
    them), from the headers alone: what the build's progress counts in MB/s."""
    src = source_specs(checkpoint_dir)
    out = []
    for s in layers:
        n = 0
        for r in s.refs().values():
            if r.name in src:
                dt, shape = src[r.name]
                n += math.prod(ref_shape(r, shape)) * dt.itemsize
        out.append(n)
    return out
