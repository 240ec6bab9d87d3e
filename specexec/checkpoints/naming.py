"""The tensors of a checkpoint as the streamed target needs them: one decoder Block's tensor names and shapes
(block_specs, block_tensor_names), the layer cache's naming of each layer's tensors (layer_names: through the
family's weight map, specexec/families/weights.py), and reading the resident embed/norm/head (read_resident).

Does not know: bytes or plans (specexec/planning/), the layer cache's storage (offload.cache), the pager, the
resident loader (loading.py, whose checks these reuse).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from offload.cache.identity import LayerNames
from offload.formats.sources import open_source
from offload.formats.tensor_source import read

from specexec.checkpoints.loading import check_tensors
from specexec.config import ModelArgs
from specexec.model import Block, on_meta

RESIDENT_NAMES = ("embed_tokens.weight", "norm.weight", "lm_head.weight")


@functools.cache
def block_specs(args: ModelArgs) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], frozenset[str]]:
    """((name, shape) of every tensor of one decoder Block in state_dict order), names of its Linear weights."""
    with on_meta():
        block = Block(args)
    shapes = tuple((n, tuple(t.shape)) for n, t in block.state_dict().items())
    linear = frozenset(f"{path}.weight" for path, m in block.named_modules() if isinstance(m, nn.Linear))
    return shapes, linear


def block_tensor_names(args: ModelArgs) -> tuple[list[str], frozenset[str]]:
    """(every tensor name of one decoder Block in state_dict order, the names of its nn.Linear weights)."""
    shapes, linear = block_specs(args)
    return [n for n, _ in shapes], linear


def layer_names(path: Path, args: ModelArgs) -> list[LayerNames]:
    """For the layer cache: per decoder layer, packed name (as the Block binds it) -> its checkpoint tensor
    (a name, or a TensorSource for a part of one: specexec.families.weight_map), and which of them are Linear
    weights. CheckpointError unless the checkpoint holds exactly what `args` implies (check_tensors: the planner
    and `convert` call this before anything is cached)."""
    names, linear = block_tensor_names(args)
    found = check_tensors(path, open_source(path), args)   # before planning or caching: a bad checkpoint caches nothing
    out = []
    for i in range(args.n_layers):
        srcs = {n: found[f"layers.{i}.{n}"] for n in names}
        out.append(LayerNames({n: src if src.ops else src.name for n, src in srcs.items()}, linear))
    return out


def read_resident(path: Path, args: ModelArgs, dtype: torch.dtype, device: torch.device,
                  host: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """embed_tokens / norm / lm_head (unless tied) from the checkpoint, shape-checked, as dtype on device (the
    names in `host` stay in CPU memory)."""
    ckpt = open_source(path)
    found = check_tensors(path, ckpt, args)
    return {name: read(ckpt.get, found[name]).to(device="cpu" if name in host else device, dtype=dtype)
            for name in RESIDENT_NAMES if name in found}
