"""Gemma 4 assistant checkpoints (Gemma4AssistantForCausalLM, model_type gemma4_assistant) named as `--draft PATH`:
found from their config.json, checked against the target, loaded as an Assistant (specexec/network/assistant.py).

config.json: text_config (a Gemma 4 decoder whose every layer reads shared K/V: no k/v projections),
backbone_hidden_size (the target's hidden size), use_ordered_embeddings with num_centroids and
centroid_intermediate_top_k. Tensors: model.layers.N.* (q_proj, q_norm, o_proj, the MLP, four norms,
layer_scalar), model.norm, model.embed_tokens (also the LM head), pre_projection [D, 2 D_t], post_projection
[D_t, D], masked_embedding.centroids and masked_embedding.token_ordering with ordered embeddings.

Checked before any weight loads, one line each: a target that is not Gemma 4, another hidden size or
vocabulary, a layer kind the target has no K/V of (or of another head size), per-layer inputs or experts in
the assistant.

Does not know: how the assistant runs, trees, the engine.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from offload.formats.refs import TensorRef
from offload.formats.sources import tensor_specs
from specexec.checkpoints.loading import open_weights
from specexec.config import ModelArgs
from specexec.drafters.load import Layout, checked_layout, expected
from specexec.network.assistant import Assistant, build_assistant
from specexec.network.drafter import DrafterShape
from specexec.options import ConfigError

KIND = "gemma4-assistant"
ARCHITECTURE = "Gemma4AssistantForCausalLM"


def is_assistant(path: Path) -> bool:
    """Whether the directory `path` holds a Gemma 4 assistant (its config.json says so)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and (cfg.get("model_type") == "gemma4_assistant"
                                      or ARCHITECTURE in (cfg.get("architectures") or ()))


def shape_of(path: Path, target: ModelArgs) -> tuple[ModelArgs, DrafterShape, dict[int | None, int],
                                                     tuple[int, int] | None]:
    """The assistant's decoder args, its shape, the target layer each of its kinds reads and its centroids,
    checked against the target (one line each)."""
    from specexec.families import gemma4            # its decoder's config is Gemma 4's

    where = f"Gemma 4 assistant {path}"
    cfg: dict[str, Any] = json.loads((path / "config.json").read_text())
    if target.family != "gemma4":
        raise ConfigError(f"{where} drafts for Gemma 4 only (it attends to the target's K/V); the target is "
                          f"{target.family}")
    text = gemma4.text_config(cfg.get("text_config") or {})
    if text.get("hidden_size_per_layer_input") or text.get("enable_moe_block"):
        raise ConfigError(f"{where}: an assistant with per-layer inputs or experts is not one transformers runs")
    args = gemma4.model_args("gemma4", {**text, "num_kv_shared_layers": 0, "use_double_wide_mlp": False})
    backbone = int(cfg.get("backbone_hidden_size", 1536))
    if backbone != target.dim:
        raise ConfigError(f"{where} reads target states of size {backbone}, the target's hidden size is "
                          f"{target.dim}; use the assistant published with this target")
    if args.vocab_size != target.vocab_size:
        raise ConfigError(f"{where} has a vocabulary of {args.vocab_size} tokens, the target {target.vocab_size}; "
                          f"use the assistant published with this target")
    sources = {}
    for i in range(args.n_layers):
        window = args.layer_kind(i).window
        source = _source(target, window is None)
        if source is None or target.attn_shape(source)[1] != args.attn_shape(i)[1]:
            what = "full-attention" if window is None else "sliding"
            raise ConfigError(f"{where}: its {what} layers read K/V the target does not hold (no such layer of "
                              f"head size {args.attn_shape(i)[1]}); use the assistant published with this target")
        sources[window] = source
    centroids = ((int(cfg.get("num_centroids", 2048)), int(cfg.get("centroid_intermediate_top_k", 32)))
                 if cfg.get("use_ordered_embeddings") else None)
    return replace(args, tie_word_embeddings=True), DrafterShape(target.dim), sources, centroids


def _source(target: ModelArgs, full: bool) -> int | None:
    """The target's last layer of a kind that computes its own K/V (what transformers hands the assistant)."""
    own = range(target.n_layers - target.kv_shared_layers)
    found = [i for i in own if (target.layer_kind(i).window is None) == full]
    return found[-1] if found else None


def refs(assistant: Assistant, specs: dict) -> dict[str, TensorRef]:
    """Our name -> the stored tensor's: the decoder under model., the rest at the top, the centroids' under
    masked_embedding."""
    out = {}
    for ours in expected(assistant, ()):
        if ours.startswith(("pre_projection.", "post_projection.")):
            stored = ours
        elif ours.startswith("centroids.") or ours == "token_ordering":
            stored = "masked_embedding." + ours
        else:
            stored = "model." + ours
        out[ours] = TensorRef(stored)
    return out


def checked(where: str, t_path: Path, target: ModelArgs, allow_pickle: bool = False) -> Layout:
    """The assistant in the directory `where`, its config and stored headers checked against the target (one line
    each), nothing read: its Layout (it shares nothing by module: its input embeds with the target's, `share`)."""
    path = Path(where)
    args, shape, sources, centroids = shape_of(path, target)
    source = open_weights(path, allow_pickle)
    specs = tensor_specs(source)
    drafter = build_assistant(args, shape, sources, centroids)
    return checked_layout(path, args, shape, drafter, (), refs(drafter, specs), source, specs)


def planned(where: str, t_path: Path, target: ModelArgs) -> Layout:
    """The assistant in the directory `where` from its config.json alone (`specexec plan`)."""
    path = Path(where)
    args, shape, sources, centroids = shape_of(path, target)
    return Layout(path, args, shape, build_assistant(args, shape, sources, centroids))
