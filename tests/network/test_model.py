"""specexec.network.model against transformers' own implementation of the same tiny checkpoints (fp32).

Covers a prefill, a cached one-token decode step and a tree forward (each node's logits equal the reference
run on its root-to-node path), for every family fixture, plus a Mistral sliding window, with the engine's
split-attention masks (TreeMask) and with the dense bool masks (prefix_tree_mask) still accepted.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specexec.kv.cache import KVCache
from specexec.checkpoints.loading import load_model
from specexec.network.model import TreeMask, prefix_tree_mask
from specexec.tree import TokenTree
from tests.network.model_reference import TOL, TREE_PARENTS, hf_model, new_cache, prefill
from tests.tiny_models import write_tiny_model

@torch.inference_mode()
def test_prefill_and_decode_match_transformers(tiny_model: Path) -> None:
    ours, ref = load_model(tiny_model), hf_model(tiny_model)
    ids = torch.randint(0, ours.args.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    want = ref(ids[None]).logits[0]
    cache = new_cache(ours)
    got_prefill = prefill(ours, cache, ids[:-1])
    got_decode = prefill(ours, cache, ids[-1:])
    assert (got_prefill - want[:-1]).abs().max() < TOL
    assert (got_decode - want[-1:]).abs().max() < TOL
    assert (ours.logits(ours(ids[None], torch.arange(24)[None])) - want).abs().max() < TOL   # no-cache path


@torch.inference_mode()
@pytest.mark.parametrize("dense", [False, True], ids=["split", "dense"])
def test_tree_forward_equals_each_path_run_sequentially(tiny_model: Path, dense: bool) -> None:
    ours, ref = load_model(tiny_model), hf_model(tiny_model)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, ours.args.vocab_size, (10,), generator=g)
    tokens = torch.randint(0, ours.args.vocab_size, (len(TREE_PARENTS),), generator=g).tolist()
    tree = TokenTree.from_lists(tokens, TREE_PARENTS)
    cache = new_cache(ours)
    prefill(ours, cache, prompt, dense)
    L = cache.length
    positions = tree.positions(L)
    mask = prefix_tree_mask(L, tree.ancestor_mask()) if dense else TreeMask(L, tree.ancestor_mask())
    hidden = ours(tree.tokens[None], positions[None], mask, cache)
    got = ours.logits(hidden)
    for node in range(len(TREE_PARENTS)):
        path = torch.cat([prompt, tree.tokens[tree.path(node)]])
        want = ref(path[None]).logits[0, -1]
        assert (got[node] - want).abs().max() < TOL, f"node {node}"


def test_ancestor_mask_and_positions() -> None:
    tree = TokenTree.from_lists(list(range(9)), TREE_PARENTS)
    mask = tree.ancestor_mask()
    for i in range(9):
        assert mask[i].nonzero().flatten().tolist() == sorted(tree.path(i))
    assert tree.positions(5).tolist() == [5, 6, 6, 7, 7, 7, 8, 8, 9]


@torch.inference_mode()
@pytest.mark.parametrize("dense", [False, True], ids=["split", "dense"])
def test_mistral_sliding_window_matches_transformers(tmp_path: Path, dense: bool) -> None:
    """Chunks longer than the window, after a prefix longer than it, one-token steps; and the no-cache path."""
    path = write_tiny_model(tmp_path / "mistral-window", "mistral", seed=7, n_layers=2, sliding_window=6)
    ours, ref = load_model(path), hf_model(path)
    assert ours.args.sliding_window == 6
    ids = torch.randint(0, ours.args.vocab_size, (24,), generator=torch.Generator().manual_seed(2))
    want = ref(ids[None]).logits[0]
    cache = new_cache(ours)
    got = torch.cat([prefill(ours, cache, ids[a:b], dense) for a, b in [(0, 12), (12, 20), (20, 21), (21, 24)]])
    assert (got - want).abs().max() < TOL
    assert (ours.logits(ours(ids[None], torch.arange(24)[None])) - want).abs().max() < TOL   # no-cache path


def test_kv_cache_keep_moves_rows_without_touching_the_prefix() -> None:
    cache = KVCache(1, 1, 2, 16, torch.float32, "cpu")
    rows = torch.arange(10, dtype=torch.float32).view(1, 1, 10, 1).expand(1, 1, 10, 2)
    cache.write(0, torch.arange(10), rows, rows)
    cache.advance(3)
    cache.keep(torch.tensor([3, 5, 8]))
    assert cache.length == 6
    assert cache.k[0, 0, 0, :6, 0].tolist() == [0, 1, 2, 3, 5, 8]
    with pytest.raises(RuntimeError):
        cache.keep(torch.arange(6, 17))


@torch.inference_mode()
def test_a_decoder_layer_of_a_tree_pass_dispatches_at_most_80_ops(tiny_llama: Path) -> None:
    """Each aten op is a kernel launch on a GPU and a dispatch on a CPU, which is most of a small draft's
    time: one layer of a tree pass over a committed prefix (two attention parts, merged) stays within 80 ops.
    It took 89 before RoPE used a roll and the two-part merge a sigmoid (77 with them)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    model = load_model(tiny_llama)
    P, cache = 8, new_cache(model)
    model(torch.arange(P)[None] + 10, torch.arange(P)[None], TreeMask(0), cache)
    cache.keep(torch.arange(P))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    positions = (P + torch.tensor([0, 1, 1, 2]))[None]
    x = model.embed_tokens(torch.arange(4)[None] + 30)
    cos, sin = model.rope(positions, x.dtype)
    plan = model.attention_plan(TreeMask(P, tree), positions, x.dtype)
    assert len(plan.parts) == 2
    with Count() as count:
        model.layers[0](x, cos, sin, plan, cache, 0, torch.arange(P, P + 4))
    assert sum(count.ops.values()) <= 80, count.ops
    assert "logsumexp" not in count.ops and "cat" not in count.ops
