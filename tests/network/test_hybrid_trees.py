"""Hybrid targets at every tree size (issue 55 §1): a verification pass of T nodes over a Gated DeltaNet layer
writes T scratch slots, more than the recurrent store's first ring of 64 rows; committing its path must replay
that path's own rows, never a later node's (specexec/kv/recurrent.py, specexec/network/linear_attention.py).

The sharpest check: prefill, one tree pass of T nodes (root -> 1 -> 2, the other T - 3 nodes leaves of the
root), keep the path root, 1, 2, decode one token, and compare its logits with transformers on
prompt + path + token, at T around the ring's size and up to the planner's largest tree (1024), for each hybrid
family at 2 layers. Then the store's own invariant: a pass's slot span grows the ring before it writes, and a
commit refuses a slot whose row another slot overwrote.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specexec.checkpoints.loading import load_model
from specexec.kv import recurrent
from specexec.kv.recurrent import MIN_RING, RecurrentSpec, RecurrentStates
from specexec.network.delta_rule import advance_state
from specexec.network.model import TreeMask
from specexec.tree import TokenTree
from tests.network.model_reference import hf_model
from tests.sync_count import SyncCounter
from tests.tiny_models import hybrid_model_2layers

FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")
TOL = 5e-4            # as tests/network/test_hybrid.py: the delta rule sums in another order than transformers'
SIZES = (10, 64, 65, 100, 256, 1024)                 # the ring starts at 64 rows; auto budgets reach 1024


@pytest.fixture(scope="module")
def pairs(tiny_root: Path) -> dict:
    """Per family: (our model, transformers' model), loaded once for the module."""
    return {name: (load_model(hybrid_model_2layers(tiny_root, name)), hf_model(hybrid_model_2layers(tiny_root, name)))
            for name in FAMILIES}


@torch.inference_mode()
@pytest.mark.parametrize("T", SIZES)
@pytest.mark.parametrize("name", FAMILIES)
def test_a_tree_pass_of_any_size_commits_its_own_path(name: str, T: int, pairs: dict) -> None:
    ours, ref = pairs[name]
    g = torch.Generator().manual_seed(T)
    prompt = torch.randint(7, 300, (10,), generator=g)
    cache = ours.new_cache(16 + T)
    L = prompt.numel()
    ours(prompt[None], torch.arange(L)[None], TreeMask(0), cache)
    cache.advance(L)
    tokens = torch.randint(7, ours.args.vocab_size, (T,), generator=g).tolist()
    tree = TokenTree.from_lists(tokens, [-1, 0, 1] + [0] * (T - 3))
    ours(tree.tokens[None], tree.positions(L)[None], TreeMask(L, tree.ancestor_mask()), cache)
    cache.keep(L + torch.tensor([0, 1, 2]))
    nxt = torch.tensor([11])
    got = ours.logits(ours(nxt[None], torch.tensor([[L + 3]]), TreeMask(L + 3), cache))[0]
    want = ref(torch.cat([prompt, tree.tokens[:3], nxt])[None]).logits[0, -1]
    assert (got - want).abs().max() < TOL


SPEC = RecurrentSpec(k_heads=1, v_heads=2, k_dim=2, v_dim=3, conv_dim=8, conv_kernel=3, advance=advance_state)


def write_span(store: RecurrentStates, prefix: int, width: int, slots: torch.Tensor) -> None:
    n, dev = slots.numel(), slots.device
    store.write(0, prefix, width, slots, slots.clone(), torch.ones(n, 1, 2, device=dev),
                torch.ones(n, 2, 3, device=dev), torch.full((n, 2), -0.1, device=dev),
                torch.full((n, 2), -0.1, device=dev), torch.ones(n, 8, device=dev))


def test_a_pass_wider_than_the_ring_grows_it_before_writing() -> None:
    """A pass of MIN_RING + 1 slots, written straight (no columns read first, as a fresh verification pass does):
    every slot keeps its own row and the commit replays it."""
    store = RecurrentStates(SPEC, 1, torch.float32, torch.device("cpu"))
    slots = torch.arange(7, 7 + MIN_RING + 1)
    write_span(store, 7, MIN_RING + 1, slots)
    assert store.ring > MIN_RING and torch.equal(store.owner[slots % store.ring], slots)
    store.keep(slots[:3], 7)                       # the root's rows are its own: no refusal


def test_a_commit_refuses_a_slot_another_slot_overwrote() -> None:
    """The invariant, checked at every commit: a writer that names too narrow a span (here: a second pass that
    claims to start at the later slot) overwrites a live slot's row; keep refuses it rather than replay it."""
    store = RecurrentStates(SPEC, 1, torch.float32, torch.device("cpu"))
    write_span(store, 5, 1, torch.tensor([5]))
    write_span(store, 5 + MIN_RING, 1, torch.tensor([5 + MIN_RING]))    # the same row modulo the ring
    with pytest.raises(RuntimeError, match="overwritten before its commit"):
        store.keep(torch.tensor([5]), 5)


def test_a_commit_makes_no_host_sync_besides_the_cpu_check(monkeypatch) -> None:
    """Budget: 0 syncs per commit (issue 62, finding 4). The overwrite check is torch._assert_async on a GPU (no
    sync; the CPU raises a clear RuntimeError instead), so it is swapped for that here; the rest once indexed G
    with a 0-dim tensor (an .item(), one sync per commit)."""
    monkeypatch.setattr(recurrent, "_check", lambda ok, why: torch._assert_async(ok.all()))
    store = RecurrentStates(SPEC, 1, torch.float32, torch.device("cpu"))
    slots = torch.arange(7, 7 + 10)
    write_span(store, 7, 10, slots)
    with SyncCounter() as c:
        store.keep(slots[:3], 7)
    assert c.total == 0 and c.uploads == 0, c.ops


@pytest.mark.gpu
def test_the_commit_check_costs_no_host_sync_on_a_gpu() -> None:
    """On CUDA the check is torch._assert_async: a commit under CUDA's sync debug mode "error" runs."""
    store = RecurrentStates(SPEC, 1, torch.float32, torch.device("cuda"))
    slots = torch.arange(7, 7 + MIN_RING + 1, device="cuda")
    write_span(store, 7, MIN_RING + 1, slots)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        store.keep(slots[:3], 7)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert store.state.abs().sum() > 0
