"""The token mixer of each decoder layer, by kind: ONE registry (MIXERS) the network builds every layer from.

A decoder layer is a token mixer (what mixes positions: attention, linear attention, ...) and a feed-forward.
config.json's `layer_types` names each layer's mixer with HF's names (ModelArgs.layer_types; every layer is
"full_attention" when a config has none); a MixerKind serves some of those names and says:
- `attribute`: the Block attribute holding the mixer, as checkpoints name it ("self_attn", ...);
- `build(args, layer)`: the mixer module (None: a layer of this kind mixes nothing, Block builds no mixer);
  every mixer is called alike, mixer(x [B, T, D], cos, sin, plan, cache, layer, slots) -> [B, T, D]; a kind's
  own shape rides in ModelArgs.mixer_args under its name (`args.mixer_args_of(name)`), not in a field of
  ModelArgs of its own;
- `state(args, layer)`: what the layer's cache holds: None for K/V rows per slot (KVCache's row stores), else
  a StateSpec of specexec/kv/ whose store the cache builds (specexec/kv/layer_store.py); `parts` of a row-keeping
  kind: 2 (K and V) or 1 (latent attention's one row read as both: specexec/kv/latent.py);
- `cache_bytes(args, layer, slots, elem, quant)`: one layer's cache for `slots` slots, and `node_bytes(args,
  layer, elem)` what it keeps per tree node beyond that (the planner's functions per kind: `cache_bytes` below);
- `streams`: whether the layer's cache may live in host RAM and travel with the layer (K/V rows: the planner's
  companions) or stays on the device (a recurrent state);
- `pass_bytes(args, tokens, context, elem, device, tree)`: the transient bytes of one layer's pass (the planner
  counts the widest kind a model has: `pass_bytes` below);
- `ffn`: whether a layer of this kind carries a feed-forward after its mixer (Block builds none otherwise);
- `plan`: what tells the mixer which tokens each new token sees, built once per forward by the model:
  "attention" (the AttentionPlan of its window) or "tree" (linear_attention.TreePlan: the ancestor mask itself).
Each kind's cache answers the two questions of a tree pass: every node's output sees only its ancestors, and
`cache.keep(slots)` commits the accepted path without weights. Nothing above the network asks which kind (or
which family) a layer is; `new_cache` makes the cache of any model from its args. A new kind is its module (the
mixer, its args, its StateSpec and store, its pass's bytes) and one row of MIXERS; a layer type no row serves is
refused here (`mixer_kind`: ConfigError), as config.py only checks that it is a name.

Does not know: checkpoints (their names are the attributes'), families, devices beyond the cache's, trees.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specexec.config import LAYER_TYPES, ModelArgs
from specexec.options import choice_error
from specexec.kv.cache import KVCache, pinned_layers
from specexec.kv.layer_store import StateSpec
from specexec.kv.recurrent import ring_rows
from specexec.kv.rows import row_bytes
from specexec.kv.latent import PARTS as LATENT_PARTS, latent_row_bytes
from specexec.network import attention, linear_attention
from specexec.network.latent import LatentAttention
from specexec.network.linear_attention import GatedDeltaNet, spec_of
from specexec.network.self_attention import Attention


@dataclass(frozen=True)
class MixerKind:
    """One kind of token mixer (see the module docstring)."""

    name: str
    layer_types: tuple[str, ...]
    attribute: str
    build: Callable[[ModelArgs, int], nn.Module]
    state: Callable[[ModelArgs, int], StateSpec | None]
    cache_bytes: Callable[[ModelArgs, int, int, int, str], int]
    plan: str = "attention"
    parts: int = 2                     # a K/V-row kind's parts per row: 2 (K and V), 1 (one row read as both)
    node_bytes: Callable[[ModelArgs, int, int], int] = lambda args, layer, elem: 0
    streams: bool = True
    pass_bytes: Callable[[ModelArgs, int, int, int, str, bool], int] = attention.pass_bytes
    ffn: bool = True


def _rows_bytes(args: ModelArgs, layer: int, slots: int, elem: int, quant: str) -> int:
    """A layer's K/V rows: its own shape; none for a layer attending to an earlier layer's (counted there)."""
    if args.kv_source(layer) != layer:
        return 0
    return slots * row_bytes(*args.attn_shape(layer), elem, quant)


def _state_bytes(args: ModelArgs, layer: int, slots: int, elem: int, quant: str) -> int:
    return spec_of(args).sequence_bytes()


ATTENTION = MixerKind("attention", ("full_attention", "sliding_attention"), "self_attn",
                      lambda args, layer: Attention(args, layer), lambda args, layer: None, _rows_bytes)
LINEAR = MixerKind("linear_attention", ("linear_attention",), "linear_attn",
                   lambda args, layer: GatedDeltaNet(args), lambda args, layer: spec_of(args), _state_bytes, "tree",
                   node_bytes=lambda args, layer, elem: spec_of(args).node_bytes(elem), streams=False,
                   pass_bytes=linear_attention.pass_bytes)
LATENT = MixerKind("latent_attention", ("latent_attention",), "self_attn", lambda args, layer: LatentAttention(args),
                   lambda args, layer: None, lambda args, layer, slots, elem, quant:
                   latent_row_bytes(args, slots, elem, quant), parts=LATENT_PARTS)

MIXERS: tuple[MixerKind, ...] = (ATTENTION, LINEAR, LATENT)
assert set(LAYER_TYPES) <= {t for kind in MIXERS for t in kind.layer_types}, \
    "every layer type the families accept needs one mixer kind"


def layer_type(args: ModelArgs, layer: int) -> str:
    """HF's name of decoder layer `layer`'s mixer ("full_attention" when the config lists none)."""
    if args.layer_types:
        return args.layer_types[layer]
    return "sliding_attention" if args.sliding_window else "full_attention"


def mixer_kind(args: ModelArgs, layer: int) -> MixerKind:
    """The MixerKind of decoder layer `layer` (ConfigError, one line, for a layer type no kind serves)."""
    name = layer_type(args, layer)
    for kind in MIXERS:
        if name in kind.layer_types:
            return kind
    raise choice_error("layer type", name, [t for kind in MIXERS for t in kind.layer_types])


def has_tree_plans(args: ModelArgs) -> bool:
    """Whether some layer's mixer reads a TreePlan (a forward then builds one)."""
    return any(mixer_kind(args, i).plan == "tree" for i in range(args.n_layers))


def layer_states(args: ModelArgs) -> tuple[Any, ...]:
    """Per decoder layer, its StateSpec (None: K/V rows)."""
    return tuple(mixer_kind(args, i).state(args, i) for i in range(args.n_layers))


def cache_bytes(args: ModelArgs, slots: int, elem: int, quant: str = "none",
                layers: Sequence[int] | None = None, nodes: int = 0) -> int:
    """Bytes of the cache of `layers` (default: every decoder layer) for `slots` slots and passes writing up to
    `nodes` slots past the committed prefix (a tree and its root; a draft's scratch), each layer by its kind."""
    ids = range(args.n_layers) if layers is None else layers
    rows = ring_rows(nodes)
    return sum(mixer_kind(args, i).cache_bytes(args, i, slots, elem, quant)
               + mixer_kind(args, i).node_bytes(args, i, elem) * rows for i in ids)


def pass_bytes(args: ModelArgs, tokens: int, context: int, elem: int, device: str, tree: bool = True) -> int:
    """Transient bytes of the widest layer pass of a model of `args` over `tokens` rows and `context` slots (each
    kind of its layers asked: MixerKind.pass_bytes; `tree`: a tree pass, else a causal prefill chunk)."""
    kinds = {mixer_kind(args, i).name: mixer_kind(args, i) for i in range(args.n_layers)}
    return max((k.pass_bytes(args, tokens, context, elem, device, tree) for k in kinds.values()), default=0)


def fixed_layers(args: ModelArgs) -> tuple[int, ...]:
    """The layers whose cache stays on the device (a recurrent state: their kind does not stream)."""
    return tuple(i for i in range(args.n_layers) if not mixer_kind(args, i).streams)


def new_cache(args: ModelArgs, capacity: int, dtype: torch.dtype, device: torch.device | str,
              quant: str = "none", **rows: Any) -> KVCache:
    """The cache of a model of `args`: K/V rows where the layers' kinds keep rows (`rows`: KVCache's streamed,
    tail and windows), a state store for the rest."""
    return KVCache(args.n_layers, args.n_kv_heads, args.head_dim, capacity, dtype, device, quant=quant,
                   states=layer_states(args), parts=row_parts(args), shapes=_shapes(args), shared=_shared(args),
                   **rows)


def pinned_rows(args: ModelArgs) -> frozenset[int]:
    """The layers whose K/V rows stay on the device even where the plan streams KV (kv/cache.pinned_layers:
    Gemma 4's full layers with their own head size, the layers whose rows later layers read)."""
    return frozenset(pinned_layers((args.n_kv_heads, args.head_dim), _shapes(args), _shared(args)))


def _shapes(args: ModelArgs) -> list[tuple[int, int]]:
    return [args.attn_shape(i) for i in range(args.n_layers)]


def _shared(args: ModelArgs) -> dict[int, int]:
    """{layer: the layer whose K/V it reads} of the layers with none of their own."""
    return {i: args.kv_source(i) for i in range(args.n_layers) if args.kv_source(i) != i}


def row_parts(args: ModelArgs) -> int:
    """The parts per K/V row of the model's row-keeping layers (one row layout per model)."""
    kinds = [mixer_kind(args, i) for i in range(args.n_layers)]
    parts = {k.parts for i, k in enumerate(kinds) if k.state(args, i) is None}
    if len(parts) > 1:
        raise ValueError(f"layers of one model keep rows of one layout; these mix {sorted(parts)} parts per row")
    return parts.pop() if parts else 2
