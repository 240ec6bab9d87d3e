"""Checkpoint tensor names -> the network's parameter names: the one mapping every reader uses.

The network's names are the Hub checkpoints' names without the leading "model." (specexec/model.py; the MoE
names in specexec/moe.py). Where a family's checkpoint names a tensor otherwise, or stores several of ours in
one tensor, its module lists WEIGHT_RULES: each Rule (specexec/families/rules.py) matches our name inside a
decoder layer (a regex over e.g. "mlp.experts.3.gate_proj.weight") and names the stored tensor inside the same
layer (a template with the regex's groups), with the piece to take (offload/formats/refs.TensorRef: one expert
of a fused tensor, strided gate/up columns, a transpose). The first matching rule wins; a name no rule matches is stored as it is.

`checkpoint_refs(args, names, stored)` gives every model tensor's TensorRef. The resident loader and the
checks before loading (specexec/checkpoints/loading.py), the layer cache's naming (specexec/checkpoints/naming.py
layer_names: packed name -> TensorRef) and the resident embed/norm/head read through it; a GGUF file's tensors
arrive under the Hub names of their family (offload/formats/gguf.py) and are mapped the same way.

Does not know: shapes (loading.py checks them against the refs), how tensors are read (offload/formats/refs).
"""
from __future__ import annotations

import re
from collections.abc import Collection, Iterable

from offload.formats.refs import TensorRef

from specexec.config import ModelArgs
from specexec.families.registry import family_module
from specexec.families.rules import Rule

LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
UNPREFIXED = frozenset({"lm_head.weight"})      # the LM head sits beside "model." in HF *ForCausalLM checkpoints


def checkpoint_prefix(stored: Iterable[str]) -> str:
    """'model.' when the checkpoint's tensor names carry it (HF *ForCausalLM checkpoints), else ''."""
    return "model." if any(n.startswith("model.layers.") for n in stored) else ""


def checkpoint_refs(args: ModelArgs, names: Iterable[str], stored: Collection[str]) -> dict[str, TensorRef]:
    """For each of our parameter `names` (full names, e.g. 'layers.3.mlp.router.weight'), the TensorRef of its
    source among the checkpoint's `stored` tensor names, by the family's WEIGHT_RULES."""
    try:
        rules = tuple(getattr(family_module(args.family), "WEIGHT_RULES", ()))
    except KeyError:                     # a ModelArgs made by hand (tests, benchmarks): the Hub names
        rules = ()
    compiled = [(re.compile(r.ours), r) for r in rules]
    prefix = checkpoint_prefix(stored)
    refs: dict[str, TensorRef] = {}
    for name in names:
        refs[name] = _ref(name, prefix, compiled, args)
    return refs


def _ref(name: str, prefix: str, rules: list[tuple[re.Pattern[str], Rule]], args: ModelArgs) -> TensorRef:
    if name in UNPREFIXED:
        return TensorRef(name)
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
