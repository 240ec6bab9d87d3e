"""Checkpoint tensor names -> the network's parameter names: one mechanism for every family and every loader.

A `WeightMap` is an ordered list of `Rule`s. The first rule whose regex matches the whole checkpoint name
decides: each of its outputs names one of our parameters (a re.sub template over the match) and how to make it
from that tensor (ops of offload.formats.tensor_source.TensorSource: a slice of a fused tensor, one expert of a
stacked one, a transpose); a rule without outputs says the tensor is not used (a vision tower, a tied head's
copy, RoPE's inv_freq). A name no rule matches is an unexpected tensor, which the loaders refuse.

`default_rules(args)` is what every family shares (the HF "model." prefix, lm_head, RoPE buffers); a family
module that needs more defines `weight_map(args)` with its own rules first (Gemma 3's multimodal checkpoints:
the text decoder under language_model, the vision tower unused). The resident loader, the offloaded target's
layer naming and its resident embed/norm/head all call `WeightMap.sources`; GGUF files are first named as HF
checkpoints by offload/formats/gguf.py, then go through the same map.

Does not know: tensors' data (only names and ops), devices, which loader asks.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from offload.formats.tensor_source import TensorSource

from specexec.config import ModelArgs


@dataclass(frozen=True)
class Rule:
    """Checkpoint names matching `pattern` (the whole name) -> `outputs`: (our name template, ops) each."""

    pattern: str
    outputs: tuple[tuple[str, tuple[tuple, ...]], ...] = ()


def rename(pattern: str, template: str) -> Rule:
    """A checkpoint tensor that is one of ours under another name."""
    return Rule(pattern, ((template, ()),))


def ignore(pattern: str) -> Rule:
    """Checkpoint tensors the model does not use."""
    return Rule(pattern)


def split(pattern: str, *outputs: tuple[str, tuple[tuple, ...]]) -> Rule:
    """A checkpoint tensor several of ours are parts of: (template, ops) per part."""
    return Rule(pattern, tuple(outputs))


@dataclass(frozen=True)
class WeightMap:
    """Ordered rules; see the module docstring."""

    rules: tuple[Rule, ...]

    def outputs(self, name: str) -> list[tuple[str, TensorSource]] | None:
        """(our name, source) for checkpoint tensor `name`: [] when it is not used, None when no rule knows it."""
        for rule in self.rules:
            m = re.fullmatch(rule.pattern, name)
            if m is not None:
                return [(m.expand(template), TensorSource(name, ops)) for template, ops in rule.outputs]
        return None

    def sources(self, names: Iterable[str]) -> tuple[dict[str, TensorSource], list[str]]:
        """({our name: its source} for every checkpoint tensor in `names`, the names no rule knows). Two
        checkpoint tensors mapping to one of our names is a CheckpointError-worthy clash: ValueError here."""
        found: dict[str, TensorSource] = {}
        unknown: list[str] = []
        for name in names:
            outs = self.outputs(name)
            if outs is None:
                unknown.append(name)
                continue
            for ours, src in outs:
                if ours in found:
                    raise ValueError(f"checkpoint tensors {found[ours].name!r} and {name!r} both map to {ours!r}")
                found[ours] = src
        return found, unknown


def default_rules(args: ModelArgs) -> tuple[Rule, ...]:
    """What every family's checkpoints share: RoPE buffers unused, lm_head (unused when tied), the "model."
    prefix of HF *ForCausalLM checkpoints dropped (names without it are taken as they are)."""
    head = ignore(r"lm_head\.weight") if args.tie_word_embeddings else rename(r"lm_head\.weight", "lm_head.weight")
    return (ignore(r".*rotary_emb\.inv_freq"), head, rename(r"model\.(.+)", r"\1"), rename(r"(.+)", r"\1"))


def default_map(args: ModelArgs) -> WeightMap:
    return WeightMap(default_rules(args))
