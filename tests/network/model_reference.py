"""Running our resident model the way the tests compare it with transformers (a helper of tests/network/
test_model.py, test_moe.py, test_families.py and test_layer_kinds.py): the reference model, a cache, a prefill
with either mask kind, the tolerance and a tree shape.
"""
from __future__ import annotations

from pathlib import Path

import torch

from specexec.kv.cache import KVCache
from specexec.network.mixers import new_cache as cache_of
from specexec.network.model import Transformer, TreeMask, prefix_tree_mask

TOL = 1e-4


def hf_model(path: Path):
    """transformers' fp32 model of a tiny checkpoint (a multimodal one as its *ForConditionalGeneration)."""
    import json

    import transformers
    from transformers import AutoModelForCausalLM

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    cls = getattr(transformers, arch) if "ConditionalGeneration" in arch else AutoModelForCausalLM
    return cls.from_pretrained(str(path), dtype=torch.float32).eval()


def new_cache(model: Transformer, capacity: int = 128) -> KVCache:
    """An fp32 CPU cache of the model's layer kinds (network/mixers.new_cache)."""
    return cache_of(model.args, capacity, torch.float32, "cpu")


def causal(T: int) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool).tril()


def prefill(model: Transformer, cache: KVCache, ids: torch.Tensor, dense: bool = False) -> torch.Tensor:
    T = ids.numel()
    pos = torch.arange(cache.length, cache.length + T)
    mask = (prefix_tree_mask(cache.length, causal(T), model.args.sliding_window, pos) if dense
            else TreeMask(cache.length))
    hidden = model(ids[None], pos[None], mask, cache)
    cache.advance(T)
    return model.logits(hidden)


TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 6]                 # a small tree: parents in BFS order
