"""EAGLE-3 heads as published (`--draft eagle3:PATH|ORG/NAME`): the EAGLE repository's and vLLM's layout, and
the `speculators` one (its layer's config nested under transformer_layer_config).

config.json is a Llama decoder's with num_hidden_layers 1, vocab_size the TARGET's, draft_vocab_size the head's
own vocabulary, optionally target_hidden_size, norm_before_residual and the target layers it reads
(eagle_aux_hidden_state_layer_ids, at the top or in eagle_config; default: 2, L // 2 and L - 3 of an L-layer
target, each the residual stream entering that layer, as vLLM and the EAGLE repository tap them). Tensors:
`midlayer.*` (or `layers.0.*`): the decoder layer, whose q/k/v read [embedding; state] (2D wide) and which has a
`hidden_norm`; `fc.weight` [D, 3 D_t] (the fusion of the three taps); `norm.weight`; `lm_head.weight` [draft
vocab, D]; `d2t` [draft vocab] (target id = draft id + d2t); `t2d` (unused); `embed_tokens.weight` when the head
has its own (else the target's is used: the EAGLE repository loads it from the target).

Every mismatch with the target (hidden size, vocabulary, layers it taps, a head of more than one layer) is one
line before any weight loads.

Does not know: how the drafter runs (specexec/network/drafter.py), trees, the engine.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from offload.formats.refs import TensorRef
from offload.formats.sources import tensor_specs
from specexec.checkpoints.loading import open_weights, resolve_model_path
from specexec.config import ModelArgs
from specexec.drafters.load import Layout, checked_layout
from specexec.families import llama
from specexec.network.drafter import Drafter, DrafterShape, Eagle3Drafter
from specexec.options import ConfigError

KIND = "eagle3"
_TOP = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual",
        "eagle_config")


def read_config(path: Path) -> dict[str, Any]:
    """The head's config.json as one flat dict (a speculators config's layer fields lifted to the top)."""
    file = path / "config.json"
    if not file.is_file():
        raise ConfigError(f"{path} has no config.json; is it an EAGLE-3 head's checkpoint directory?")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file} is not readable JSON ({e})") from None
    layer = cfg.get("transformer_layer_config")
    if isinstance(layer, dict):
        cfg = {**layer, **{k: cfg[k] for k in _TOP if k in cfg}}
    return cfg


def default_taps(n_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads when its config names none: low, middle, high."""
    return tuple(sorted({2, n_layers // 2, n_layers - 3}))


def shape_of(cfg: dict[str, Any], target: ModelArgs, path: Path) -> tuple[ModelArgs, DrafterShape]:
    """The head's decoder-layer args and DrafterShape, checked against the target (one line each)."""
    where = f"EAGLE-3 head {path}"
    try:
        args = llama.model_args("llama", {**cfg, "num_hidden_layers": 1})
        layers = int(cfg.get("num_hidden_layers", 1))
        vocab, dim = int(cfg["vocab_size"]), int(cfg["hidden_size"])
    except KeyError as e:
        raise ConfigError(f"{where}: config.json lacks {e.args[0]!r}") from None
    if layers != 1:
        raise ConfigError(f"{where} has {layers} decoder layers; an EAGLE-3 head has one")
    if vocab != target.vocab_size:
        raise ConfigError(f"{where} is for a vocabulary of {vocab} tokens, the target has {target.vocab_size}; "
                          f"use a head trained for this target")
    t_dim = int(cfg.get("target_hidden_size") or dim)
    if t_dim != target.dim:
        raise ConfigError(f"{where} reads target states of size {t_dim}, the target's hidden size is {target.dim}; "
                          f"use a head trained for this target")
    eagle = cfg.get("eagle_config") or {}
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    uses_aux = bool(eagle.get("use_aux_hidden_state", True))
    taps = tuple(sorted(int(i) for i in ids)) if ids else default_taps(target.n_layers)
    bad = [i for i in taps if not 0 <= i <= target.n_layers]
    if uses_aux and bad:
        raise ConfigError(f"{where} reads target layer {bad[0]}, the target has {target.n_layers} layers; "
                          f"use a head trained for this target")
    draft_vocab = int(cfg.get("draft_vocab_size") or vocab)
    shape = DrafterShape(target.dim, taps if uses_aux else (), draft_vocab,
                         bool(cfg.get("norm_before_residual", False)))
    return replace(args, vocab_size=vocab, tie_word_embeddings=False), shape


def stored_names(drafter: Drafter, specs: dict) -> dict[str, TensorRef]:
    """Our name -> the stored tensor's: midlayer.X (or layers.0.X) -> layers.0.X, fc -> fuse, the rest alike;
    a leading "model." is allowed."""
    stored = {n.removeprefix("model."): n for n in specs}
    names = {}
    for ours in list(dict(drafter.named_parameters())) + ["d2t"]:
        key = ours.replace("fuse.", "fc.", 1)
        for candidate in (key.replace("layers.0.", "midlayer.", 1), key):
            if candidate in stored:
                names[ours] = TensorRef(stored[candidate])
                break
    return names


def checked(where: str, t_path: Path, target: ModelArgs, allow_pickle: bool = False) -> Layout:
    """The head `where` names, its config and stored headers checked against the target (one line each), nothing
    read: its Layout (our name -> stored tensor, the open source)."""
    path = resolve_model_path(where)
    args, shape = shape_of(read_config(path), target, path)
    source = open_weights(path, allow_pickle)
    specs = tensor_specs(source)
    drafter = Eagle3Drafter.build(args, shape)
    names = stored_names(drafter, specs)
    if shape.draft_vocab != args.vocab_size and "d2t" not in names:
        raise ConfigError(f"EAGLE-3 head {path} has a vocabulary of {shape.draft_vocab} tokens but no d2t map to "
                          f"the target's {args.vocab_size}")
    if "d2t" not in names:
        del drafter._buffers["d2t"]
    if "embed_tokens.weight" not in names and args.dim != shape.target_dim:
        raise ConfigError(f"EAGLE-3 head {path} has no embedding of its own and a hidden size of {args.dim}; it "
                          f"cannot share the target's ({shape.target_dim})")
    shared = () if "embed_tokens.weight" in names else ("embed_tokens",)
    return checked_layout(path, args, shape, drafter, shared, names, source, specs)


def planned(where: str, t_path: Path, target: ModelArgs) -> Layout:
    """The head `where` names from its config.json alone (`specexec plan`): assumed to share the target's
    embedding."""
    path = resolve_model_path(where)
    args, shape = shape_of(read_config(path), target, path)
    return Layout(path, args, shape, Eagle3Drafter.build(args, shape), ("embed_tokens",))
