"""MTP layers read from the target's own checkpoint (`--draft mtp`): the multi-token-prediction layer a model was
trained with, stored beside its decoder.

Two layouts, as published:
- next-n (DeepSeek-V3/R1, GLM-4.5/4.6/4.7): layer num_hidden_layers of the decoder, `model.layers.N.` +
  `eh_proj` [D, 2D] over [enorm(embedding); hnorm(state)], `enorm`, `hnorm`, the decoder layer's own tensors
  (attention, the MoE with all its experts), `shared_head.norm` (its final norm) and `shared_head.head` (a copy
  of the LM head; the target's is used), often an `embed_tokens` copy (the target's is used). The row at position
  0 reads a zero embedding (vLLM's and the DeepSeek recipe's rule);
- mtp.* (Qwen3.5/3.6, Qwen3-Next): `mtp.fc` over [pre_fc_norm_embedding(embedding); pre_fc_norm_hidden(state)],
  `mtp.layers.0.*` (one decoder layer of the model's own kind: full attention), `mtp.norm`; the target's
  embedding and LM head.
Either way the state handed to the next level is the layer's normed output, as the target's state is its normed
output (SGLang's reading; vLLM hands on the next-n layer's output before its norm). The decoder layer's tensors
are named by the target family's own rules (specexec/checkpoints/weight_map.py), so an expert stored fused is read as
the target's are.

Checked before any weight loads (one line each): a config without an MTP layer, a checkpoint whose copy left the
MTP tensors out, a GGUF target.

Does not know: how the drafter runs (specexec/network/drafter.py), trees, the engine, the memory plan.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from offload.formats.refs import TensorRef
from offload.formats.sources import is_gguf, tensor_specs
from specexec.checkpoints.loading import open_weights, read_args, resolve_model_path
from specexec.config import ModelArgs
from specexec.drafters.load import Layout, checked_layout
from specexec.checkpoints.weight_map import checkpoint_prefix, checkpoint_refs
from specexec.network.drafter import Drafter, DrafterShape, MtpDrafter
from specexec.network.mixers import mixer_kind
from specexec.options import ConfigError

KIND = "mtp"
SHARED = ("embed_tokens", "lm_head")          # the target's embedding and LM head


@dataclass(frozen=True)
class Stored:
    """Where an MTP layer's tensors live: its decoder layer's prefix and its own tensors (ours -> stored)."""

    name: str
    layer_prefix: str
    own: tuple[tuple[str, str], ...]
    mask_first: bool


def find_layout(args: ModelArgs, stored: set[str]) -> Stored | None:
    """The MTP layout the stored names hold (None: no MTP tensors)."""
    prefix, _ = checkpoint_prefix(args, stored)
    nextn = f"{prefix}layers.{args.n_layers}."
    if nextn + "eh_proj.weight" in stored:
        own = (("proj.weight", "eh_proj.weight"), ("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
               ("norm.weight", "shared_head.norm.weight"))
        return Stored("next-n", nextn, tuple((o, nextn + s) for o, s in own), True)
    if "mtp.fc.weight" in stored:
        own = (("proj.weight", "mtp.fc.weight"), ("enorm.weight", "mtp.pre_fc_norm_embedding.weight"),
               ("hnorm.weight", "mtp.pre_fc_norm_hidden.weight"), ("norm.weight", "mtp.norm.weight"))
        return Stored("mtp.*", "mtp.layers.0.", own, False)
    return None


def has_mtp_layer(model: str | None) -> bool:
    """Whether the checkpoint `model` names (a path, or a name already on this machine) stores an MTP layer
    (headers only; False when it cannot tell: loading it says why)."""
    try:
        path = resolve_model_path(model)
        if is_gguf(path):
            return False
        return find_layout(read_args(path), set(tensor_specs(open_weights(path)))) is not None
    except (ConfigError, ValueError, OSError):
        return False


def layer_args(args: ModelArgs) -> ModelArgs:
    """The MTP decoder layer's args: one layer of the model's own attention kind (the last layer type whose mixer
    keeps K/V rows, not a recurrent state: network/mixers.py), sparse when layer num_hidden_layers of the model
    would be (an MoE's MTP layer carries all its experts)."""
    types = [t for i, t in enumerate(args.layer_types) if mixer_kind(args, i).state(args, i) is None]
    moe = args.moe
    if moe is not None:
        moe = replace(moe, dense_layers=() if moe.sparse(args.n_layers) else (0,))
    return replace(args, n_layers=1, layer_types=tuple(types[-1:]), moe=moe, mtp_layers=0)


def check_target(path: Path, args: ModelArgs, allow_pickle: bool = False) -> tuple[Stored, object, dict]:
    """The target's MTP layout, its open source and stored headers (name -> dtype, shape); ConfigError (one
    line) when it has none."""
    if is_gguf(path):
        raise ConfigError(f"--draft mtp: {path} is a GGUF file; its MTP layer is not read yet: name a draft, or "
                          f"use the safetensors checkpoint")
    source = open_weights(path, allow_pickle)
    specs = tensor_specs(source)
    stored = set(specs)
    layout = find_layout(args, stored)
    if layout is None:
        said = ("config.json names no MTP layer (num_nextn_predict_layers)" if not args.mtp_layers else
                f"config.json names {args.mtp_layers} MTP layer(s) but this copy of the checkpoint holds none of "
                f"their tensors")
        raise ConfigError(f"--draft mtp: {path} has no MTP layer to draft with ({said}); name a draft model, "
                          f"or --draft self")
    return layout, source, specs


def refs(args: ModelArgs, drafter: Drafter, layout: Stored, stored: set[str]) -> dict[str, TensorRef]:
    """Our name -> the stored tensor, the decoder layer's by the family's rules for layer N, moved to the
    layout's prefix."""
    n = args.n_layers
    inside = [name.removeprefix("layers.0.") for name, _ in drafter.named_parameters() if name.startswith("layers.0.")]
    prefix, _ = checkpoint_prefix(args, stored)
    found = checkpoint_refs(args, [f"layers.{n}.{i}" for i in inside], stored)
    at = f"{prefix}layers.{n}."
    out = {f"layers.0.{i}": replace(found[f"layers.{n}.{i}"],
                                   name=layout.layer_prefix + found[f"layers.{n}.{i}"].name.removeprefix(at))
           for i in inside}
    return out | {ours: TensorRef(name) for ours, name in layout.own}


def shape_of(args: ModelArgs, layout: Stored) -> tuple[ModelArgs, DrafterShape]:
    return layer_args(args), DrafterShape(args.dim, mask_first=layout.mask_first)


def checked(where: str, path: Path, args: ModelArgs, allow_pickle: bool = False) -> Layout:
    """The MTP layer of the target at `path` (`where` is ""), checked against its stored headers: its Layout
    (the target's embedding and LM head shared)."""
    stored_at, source, specs = check_target(path, args, allow_pickle)
    d_args, shape = shape_of(args, stored_at)
    drafter = MtpDrafter.build(d_args, shape)
    return checked_layout(path, d_args, shape, drafter, SHARED, refs(args, drafter, stored_at, set(specs)), source,
                          specs)


def planned(where: str, path: Path, args: ModelArgs) -> Layout:
    """The MTP layer from the target's config.json alone (`specexec plan`)."""
    if not args.mtp_layers:
        raise ConfigError(f"--draft mtp: {path} has no MTP layer to draft with (config.json names none: "
                          f"num_nextn_predict_layers); name a draft model, or --draft self")
    d_args, shape = layer_args(args), DrafterShape(args.dim)
    return Layout(path, d_args, shape, MtpDrafter.build(d_args, shape), SHARED)
