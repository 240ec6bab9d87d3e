"""The tensors of a checkpoint as the streamed target needs them: one decoder Block's tensor names and shapes
(block_specs, block_tensor_names; a dense and a sparse layer of an MoE model differ), the layer cache's naming
of each layer's tensors (layer_names), and reading the resident embed/norm/head (read_resident). Both go
through the family's weight-name mapping (specexec/checkpoints/weight_map.py): our name -> the TensorRef of its
source, a stored tensor or one expert's piece of a fused one.

Does not know: bytes or plans (specexec/planning/), the layer cache's storage (offload.cache), the pager, the
resident loader (loading.py, whose checks these reuse).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from offload.cache.identity import LayerNames
from offload.formats.checkpoint import CheckpointError
from offload.formats.refs import aligned, read_ref, ref_shape
from offload.formats.sources import open_source

from specexec.checkpoints.loading import check_tensors, expected_shapes
from specexec.config import ModelArgs
from specexec.checkpoints.weight_map import checkpoint_refs
from specexec.network.mixers import mixer_kind
from specexec.network.model import Block, on_meta

RESIDENT_NAMES = ("embed_tokens.weight", "norm.weight", "lm_head.weight", "embed_tokens_per_layer.weight",
                  "per_layer_model_projection.weight", "per_layer_projection_norm.weight")   # (Gemma 4's last 3)
EXPERT_PREFIX = "mlp.experts."         # + "{e}.": one routed expert's tensors (specexec/network/moe.py)


def sparse_layer(args: ModelArgs, layer: int) -> bool:
    """Whether decoder layer `layer` has the routed (MoE) feed-forward."""
    return args.moe is not None and args.moe.sparse(layer)


@functools.cache
def layer_form(args: ModelArgs, layer: int) -> int:
    """The first decoder layer whose tensors have decoder layer `layer`'s names and shapes (layers of one form
    share every size: dense or routed, the mixer kind, the attention's shape, K/V of its own or another's)."""
    def form(i: int) -> tuple:
        return (sparse_layer(args, i), mixer_kind(args, i).name, args.attn_shape(i), args.kv_source(i) == i,
                args.global_k_eq_v and args.layer_kind(i).window is None)
    want = form(layer)
    return next(i for i in range(layer + 1) if form(i) == want)


def block_specs(args: ModelArgs, layer: int = 0) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], frozenset[str]]:
    """((name, shape) of every tensor of decoder layer `layer`'s Block in state_dict order), names of its Linear
    weights."""
    return form_specs(args, layer_form(args, layer))


@functools.cache
def form_specs(args: ModelArgs, layer: int) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], frozenset[str]]:
    """block_specs of decoder layer `layer` (built on meta once per form: layer_form)."""
    with on_meta():
        block = Block(args, layer)
    shapes = tuple((n, tuple(t.shape)) for n, t in block.state_dict().items())
    linear = frozenset(f"{path}.weight" for path, m in block.named_modules() if isinstance(m, nn.Linear))
    return shapes, linear


def expert_regions(args: ModelArgs, layer: int = 0) -> tuple[str, ...]:
    """The packed-name prefixes of decoder layer `layer`'s routed experts ("mlp.experts.{e}.", e = 0 .. E-1):
    each is its own aligned region of the packed layer (offload/streaming/storage.py), so a streamed pass can
    read or copy one expert alone; () for a dense layer. The router and a shared expert stay in the dense part."""
    if not sparse_layer(args, layer):
        return ()
    return tuple(f"{EXPERT_PREFIX}{e}." for e in range(args.moe.n_experts))


def block_tensor_names(args: ModelArgs, layer: int = 0) -> tuple[list[str], frozenset[str]]:
    """(every tensor name of decoder layer `layer`'s Block in state_dict order, the names of its nn.Linear
    weights); a sparse (MoE) layer's experts are `mlp.experts.{e}.*`, one expert's tensors adjacent."""
    shapes, linear = block_specs(args, layer)
    return [n for n, _ in shapes], linear


def layer_names(path: Path, args: ModelArgs) -> list[LayerNames]:
    """For the layer cache: per decoder layer, packed name (as the Block binds it) -> its source in the
    checkpoint (a bare name for a whole stored tensor, else a TensorRef), and which of them are Linear
    weights; a sparse layer's experts each a region (expert_regions). CheckpointError unless the checkpoint holds exactly what `args` implies (check_tensors: the
    planner and `convert` call this before anything is cached)."""
    refs = check_tensors(path, open_source(path), args)   # before planning or caching: a bad one caches nothing
    out = []
    for i in range(args.n_layers):
        names, linear = block_tensor_names(args, i)
        tensors = {n: refs[f"layers.{i}.{n}"] for n in names}
        out.append(LayerNames({n: r.name if r.plain else r for n, r in tensors.items()}, linear,
                              expert_regions(args, i)))
    return out


def read_resident(path: Path, args: ModelArgs, dtype: torch.dtype, device: torch.device,
                  host: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """embed_tokens / norm / lm_head (unless tied) from the checkpoint, shape-checked, as dtype on device (the
    names in `host` stay in CPU memory)."""
    ckpt = open_source(path)
    shapes = expected_shapes(args)
    refs = checkpoint_refs(args, [n for n in RESIDENT_NAMES if n in shapes], ckpt.names())  # no tied lm_head
    out: dict[str, torch.Tensor] = {}
    for name, ref in refs.items():
        if ref_shape(ref, tuple(ckpt.shape(ref.name))) != shapes[name]:
            raise CheckpointError(f"{path}: {ref.describe()} has shape {list(ckpt.shape(ref.name))}, config.json "
                                  f"implies {list(shapes[name])}")
        out[name] = aligned(read_ref(ckpt, ref).to(device="cpu" if name in host else device, dtype=dtype))
    return out
