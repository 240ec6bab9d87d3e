"""A draft with sliding-window layers grows its tree deeper than its window (issue 55 §1's audit): its passes
see the tree through a mask K columns wide (the whole tree's scratch, K > the pass's rows), so the attention
can window the tree part only by the columns' positions, which DraftState keeps per slot
(specexec/builders/base.py DraftState.tree_mask). Without them a node past the window saw its farthest
ancestors: draft logits off by up to ~24 on the tiny Gemma 2 (window 6) at depth 9, so fewer accepted tokens
(never another output: the target verifies).
"""
from __future__ import annotations

from pathlib import Path

import torch

from specexec.builders.base import DraftState
from specexec.checkpoints.loading import load_model
from specexec.network.model import TreeMask
from tests.tiny_models import TINY_WINDOW, family_model

TOL = 1e-4


@torch.inference_mode()
def test_a_chain_deeper_than_the_window_equals_the_causal_pass(tiny_root: Path) -> None:
    model = load_model(family_model(tiny_root, "gemma2"))
    assert min(k.window for k in model.args.layer_kinds if k.window) == TINY_WINDOW
    g = torch.Generator().manual_seed(0)
    prompt, chain = torch.randint(7, 300, (12,), generator=g), torch.randint(7, 300, (2 * TINY_WINDOW,), generator=g)
    L, depth, width = prompt.numel(), chain.numel(), 3 * TINY_WINDOW            # width > depth > window
    want = model.logits(model(torch.cat([prompt, chain])[None], torch.arange(L + depth)[None], TreeMask(0),
                              model.new_cache(64)))[L:]
    draft = DraftState(model, model.new_cache(64))
    model(prompt[None], torch.arange(L)[None], TreeMask(0), draft.cache)
    draft.cache.advance(L)
    seen = torch.zeros(width, width, dtype=torch.bool)
    got = []
    for d in range(depth):                                      # one node a pass, as a chain grows
        seen[d] = seen[d - 1] if d else seen[d]
        seen[d, d] = True
        got.append(draft.forward(chain[d:d + 1], torch.tensor([L + d]), seen[d:d + 1], torch.tensor([L + d]))[0])
    assert (torch.stack(got) - want).abs().max() < TOL
