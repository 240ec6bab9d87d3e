"""Checkpoint tensor names -> the network's parameter names: the one mapping every reader uses.

The network's names are the Hub checkpoints' names without the leading "model." (specexec/network/model.py; the MoE
names in specexec/network/moe.py). Where a family's checkpoint names a tensor otherwise, or stores several of ours in
one tensor, its module lists WEIGHT_RULES: each Rule (specexec/families/weight_rules.py) matches our name inside a
decoder layer (a regex over e.g. "mlp.experts.3.gate_proj.weight") and names the stored tensor inside the same
layer (a template with the regex's groups), with the piece to take (offload/formats/refs.TensorRef: one expert
of a fused tensor, strided gate/up columns, a transpose). The first matching rule wins; a name no rule matches
is stored as it is.

Where the decoder sits in the checkpoint: under "model." (HF *ForCausalLM) or at the top level, with the LM
head beside it; a family whose checkpoints nest the decoder (Gemma 3's multimodal ones: language_model.model.*
or model.language_model.*) lists STORED_PREFIXES, {decoder prefix: head prefix}, tried first. Stored tensors
deliberately not read (RoPE's inv_freq, a tied head's copy, the family's UNUSED patterns: Gemma 3's vision
tower and projector, and the next-token-prediction layers stored after the decoder: ModelArgs.mtp_layers) are
`unused_tensors`: the checks neither refuse them as unexpected nor read them.

`checkpoint_refs(args, names, stored)` gives every model tensor's TensorRef. The resident loader and the
checks before loading (specexec/checkpoints/loading.py), the layer cache's naming (specexec/checkpoints/naming.py
layer_names: packed name -> TensorRef) and the resident embed/norm/head read through it; a GGUF file's tensors
arrive under the Hub names of their family (offload/formats/gguf.py) and are mapped the same way.

Does not know: shapes (loading.py checks them against the refs), how tensors are read (offload/formats/refs).
"""
from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from typing import Any

from offload.formats.refs import TensorRef

from specexec.config import ModelArgs
from specexec.families.registry import family_module
from specexec.families.weight_rules import Rule

LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
HEAD = "lm_head.weight"                        # the LM head sits beside "model." in HF *ForCausalLM checkpoints
PREFIXES = {"model.": ""}                      # decoder prefix -> head prefix every family's checkpoints may use
ALWAYS_UNUSED = (r".*rotary_emb\.inv_freq",)   # RoPE's buffers, saved by old transformers


def checkpoint_prefix(args: ModelArgs, stored: Iterable[str]) -> tuple[str, str]:
    """(decoder prefix, head prefix) of the checkpoint's stored names: the first of the family's STORED_PREFIXES
    and then "model." whose decoder layers the checkpoint holds, else ("", "") (names as ours)."""
    names = list(stored)
    for decoder, head in {**_family(args, "STORED_PREFIXES", {}), **PREFIXES}.items():
        if any(n.startswith(decoder + "layers.") for n in names):
            return decoder, head
    return "", ""


def checkpoint_refs(args: ModelArgs, names: Iterable[str], stored: Collection[str]) -> dict[str, TensorRef]:
    """For each of our parameter `names` (full names, e.g. 'layers.3.mlp.router.weight'), the TensorRef of its
    source among the checkpoint's `stored` tensor names, by the family's WEIGHT_RULES and STORED_PREFIXES."""
    compiled = [(re.compile(r.ours), r) for r in _family(args, "WEIGHT_RULES", ())]
    prefix, head = checkpoint_prefix(args, stored)
    return {name: _ref(name, prefix, head, compiled, args) for name in names}


def unused_tensors(args: ModelArgs, stored: Iterable[str]) -> set[str]:
    """The stored names the model deliberately does not read: RoPE's inv_freq, the head's copy when the
    embeddings are tied, and the family's UNUSED patterns (full-match regexes: Gemma 3's vision tower)."""
    names = list(stored)
    prefix, head = checkpoint_prefix(args, names)
    extra = tuple(rf"{re.escape(prefix)}layers\.{args.n_layers + j}\..*" for j in range(args.mtp_layers))
    pattern = re.compile("|".join(ALWAYS_UNUSED + tuple(_family(args, "UNUSED", ())) + extra))
    return {n for n in names if pattern.fullmatch(n) or (args.tie_word_embeddings and n == head + HEAD)}


def _family(args: ModelArgs, attribute: str, default: Any) -> Any:
    """One of the family module's weight-naming attributes (default for a ModelArgs made by hand: tests,
    benchmarks)."""
    try:
        return getattr(family_module(args.family), attribute, default)
    except KeyError:
        return default


def _ref(name: str, prefix: str, head: str, rules: list[tuple[re.Pattern[str], Rule]], args: ModelArgs
         ) -> TensorRef:
    if name == HEAD:
        return TensorRef(head + name)
    layer = LAYER.match(name)
    if layer is not None:
        inside = layer.group(2)
        for pattern, rule in rules:
            m = pattern.fullmatch(inside)
            if m is not None:
                return rule.ref(m, f"{prefix}layers.{layer.group(1)}.", args)
    return TensorRef(prefix + name)


def layer_refs(refs: dict[str, TensorRef], layer: int) -> dict[str, TensorRef]:
    """Decoder layer `layer`'s refs by the name inside the layer ('mlp.experts.0.up_proj.weight')."""
    head = f"layers.{layer}."
    return {n[len(head):]: r for n, r in refs.items() if n.startswith(head)}
