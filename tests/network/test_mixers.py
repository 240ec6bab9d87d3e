"""The mixer-kind registry (specexec/network/mixers.py): every layer type config.json may name has one kind, a
Block holds its layer's mixer under the kind's attribute, and the planner's cache bytes are the cache's."""
from __future__ import annotations

import torch

from specexec.config import LAYER_TYPES, ModelArgs
from specexec.network.mixers import MIXERS, cache_bytes, layer_type, mixer_kind, new_cache
from specexec.network.model import Block
from specexec.network.self_attention import Attention


def _args(**kw) -> ModelArgs:
    return ModelArgs(family="llama", vocab_size=32, dim=16, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=8,
                     intermediate_size=32, **kw)


def test_every_layer_type_has_one_kind() -> None:
    """(Kinds may share a checkpoint attribute: DeepSeek's latent attention is `self_attn` too.)"""
    served = [t for kind in MIXERS for t in kind.layer_types]
    assert sorted(served) == sorted(LAYER_TYPES)
    assert len({kind.name for kind in MIXERS}) == len(MIXERS)
    assert all(kind.attribute.isidentifier() for kind in MIXERS)


def test_block_holds_its_kinds_mixer() -> None:
    args = _args(layer_types=("full_attention", "sliding_attention", "full_attention"), sliding_window=4)
    for i in range(args.n_layers):
        block = Block(args, i)
        kind = mixer_kind(args, i)
        assert block.mixer is getattr(block, kind.attribute) and isinstance(block.mixer, Attention)
    assert layer_type(_args(), 0) == "full_attention"
    assert layer_type(_args(sliding_window=4), 2) == "sliding_attention"


def test_planned_cache_bytes_are_the_cache_s() -> None:
    args = _args()
    cache = new_cache(args, 40, torch.float32, "cpu")
    assert cache_bytes(args, 40, 4) == cache.nbytes
    assert cache_bytes(args, 40, 4, layers=[1]) * 3 == cache.nbytes
