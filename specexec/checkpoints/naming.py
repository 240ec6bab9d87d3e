"""The tensors of a checkpoint as the streamed target needs them: one decoder Block's tensor names and shapes
(block_specs, block_tensor_names), the "model." prefix HF checkpoints carry (checkpoint_prefix), the layer
cache's naming of each layer's tensors (layer_names), and reading the resident embed/norm/head (read_resident).

Does not know: bytes or plans (specexec/planning/), the layer cache's storage (offload.cache), the pager, the
resident loader (loading.py, whose checks these reuse).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from offload.cache.identity import LayerNames
from offload.formats.checkpoint import CheckpointError
from offload.formats.sources import open_source

from specexec.checkpoints.loading import check_tensors, expected_shapes
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


def checkpoint_prefix(names: Sequence[str]) -> str:
    """'model.' when the checkpoint's tensor names carry it (HF *ForCausalLM checkpoints), else ''."""
    return "model." if any(n.startswith("model.layers.") for n in names) else ""


def layer_names(path: Path, args: ModelArgs) -> list[LayerNames]:
    """For the layer cache: per decoder layer, packed name (as the Block binds it) -> checkpoint name, and
    which of them are Linear weights. CheckpointError unless the checkpoint holds exactly what `args` implies
    (check_tensors: the planner and `convert` call this before anything is cached)."""
    names, linear = block_tensor_names(args)
    source = open_source(path)
    check_tensors(path, source, args)          # before planning or caching: a bad checkpoint caches nothing
    stored = set(source.names())
    prefix = checkpoint_prefix(list(stored))
    out = []
    for i in range(args.n_layers):
        tensors = {n: f"{prefix}layers.{i}.{n}" for n in names}
        missing = [t for t in tensors.values() if t not in stored]
        if missing:
            raise CheckpointError(f"{path}: tensor {missing[0]!r} is missing ({len(missing)} missing for layer {i})")
        out.append(LayerNames(tensors, linear))
    return out


def read_resident(path: Path, args: ModelArgs, dtype: torch.dtype, device: torch.device,
                  host: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """embed_tokens / norm / lm_head (unless tied) from the checkpoint, shape-checked, as dtype on device (the
    names in `host` stay in CPU memory)."""
    ckpt = open_source(path)
    prefix = checkpoint_prefix(ckpt.names())
    shapes = expected_shapes(args)
    out: dict[str, torch.Tensor] = {}
    for name in RESIDENT_NAMES:
        if name not in shapes:                    # lm_head of a tied model
            continue
        raw = name if name == "lm_head.weight" else prefix + name
        if tuple(ckpt.shape(raw)) != shapes[name]:
            raise CheckpointError(f"{path}: {raw} has shape {list(ckpt.shape(raw))}, config.json implies "
                                  f"{list(shapes[name])}")
        out[name] = ckpt.get(raw).to(device="cpu" if name in host else device, dtype=dtype)
    return out
