"""Split attention (specexec/network/attention.py) against the dense-mask path, and what it builds per forward.

The committed prefix is attended without a mask, the new tokens' own keys with the small tree/causal mask,
and the parts are merged by log-sum-exp. Checked here, all in fp32 on tiny models:
- the model's output equals the dense bool mask path (`prefix_tree_mask`) for many random trees, prefill
  chunks and draft-shaped passes, prefixes up to 32k, every family, sliding windows of many widths;
- the three kernels (CPU fused, CUDA layout with its plain fallback, plain maths) agree with an fp64 softmax;
- the mask is built once per forward, never per layer, never G-fold, never over the prefix, and the prefix
  part runs in the fused kernel with no mask (counted with a TorchDispatchMode);
- the engine's prefill and verification and the draft's passes go through the split.
The cache is filled with random K/V (only the attention algebra is under test; test_model.py checks the model
against transformers). Outputs are compared relative to their magnitude: |split - dense| <= 1e-5 * max(1, |dense|).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specexec.network import attention
from specexec.network.attention import TreeMask, attend, build_plan
from specexec.builders.base import DraftState
from specexec.kv.cache import KVCache
from specexec.checkpoints.loading import load_model
from specexec.network.model import Transformer, prefix_tree_mask
from specexec.tree import TokenTree
from tests.tiny_models import write_tiny_model

TOL = 1e-5
FLASH_CPU = "_scaled_dot_product_flash_attention_for_cpu"


def close(got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> float:
    """Max abs difference over max(1, max |want|): 0 when equal, <= tol when equal up to fp32 rounding."""
    return float((got.double() - want.double()).abs().max() / max(1.0, float(want.abs().max())))


def random_tree(n: int, gen: torch.Generator, vocab: int, chain: float = 0.0) -> TokenTree:
    """n nodes; each node's parent is uniform over the earlier ones, or (with probability `chain`) the last."""
    parents = [-1]
    for i in range(1, n):
        deep = float(torch.rand((), generator=gen)) < chain
        parents.append(i - 1 if deep else int(torch.randint(0, i, (), generator=gen)))
    return TokenTree.from_lists(torch.randint(0, vocab, (n,), generator=gen).tolist(), parents)


def random_cache(model: Transformer, length: int, scratch: int, gen: torch.Generator,
                 dtype: torch.dtype = torch.float32) -> KVCache:
    a = model.args
    cache = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, length + scratch, dtype, "cpu")
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    cache.length = length
    return cache


def with_window(model: Transformer, window: int | None) -> Transformer:
    model.args = dataclasses.replace(model.args, sliding_window=window)
    return model


def dense_mask(P: int, tree: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor,
               window: int | None) -> torch.Tensor:
    """The dense reference [1, 1, T, P + K]: all of the prefix (slot j = position j) plus `tree` [T, K],
    every key further back than window - 1 positions hidden."""
    T = tree.shape[0]
    mask = torch.cat([torch.ones(T, P, dtype=torch.bool), tree], dim=1)
    if window is not None:
        keys = torch.cat([torch.arange(P), key_positions])
        mask &= (positions[:, None] - keys[None]) < window
    return mask.view(1, 1, T, -1)


@torch.inference_mode()
def split_vs_dense(model: Transformer, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                   tree: torch.Tensor | None, slots: torch.Tensor | None = None,
                   key_positions: torch.Tensor | None = None) -> float:
    """Relative max difference of the model's output: TreeMask vs the dense mask, on the same cache."""
    P, T = cache.length, tokens.numel()
    full = torch.ones(T, T, dtype=torch.bool).tril() if tree is None else tree
    kpos = positions if key_positions is None else key_positions
    dense = dense_mask(P, full, positions, kpos, model.args.sliding_window)
    split = model(tokens[None], positions[None], TreeMask(P, tree, key_positions), cache, slots)
    want = model(tokens[None], positions[None], dense, cache, slots)
    return close(split, want)


# ------------------------------------------------------------------------------------- the model, fp32

TREE_SHAPES = [(1, 0.0), (2, 0.0), (5, 0.5), (33, 0.2), (64, 0.9), (128, 0.0)]


@pytest.mark.parametrize("prefix", [0, 1, 17, 300, 4096])
def test_tree_split_equals_dense_mask(tiny_model: Path, prefix: int) -> None:
    model = load_model(tiny_model)
    gen = torch.Generator().manual_seed(prefix)
    for n, chain in TREE_SHAPES:
        tree = random_tree(n, gen, model.args.vocab_size, chain)
        cache = random_cache(model, prefix, n, gen)
        err = split_vs_dense(model, cache, tree.tokens, tree.positions(prefix), tree.ancestor_mask())
        assert err <= TOL, f"{n}-node tree after {prefix} tokens: {err:.2e}"


@pytest.mark.parametrize("prefix", [0, 5, 1000])
def test_prefill_chunk_split_equals_dense_mask(tiny_model: Path, prefix: int) -> None:
    model = load_model(tiny_model)
    gen = torch.Generator().manual_seed(prefix + 1)
    for T in (1, 7, 64):
        tokens = torch.randint(0, model.args.vocab_size, (T,), generator=gen)
        cache = random_cache(model, prefix, T, gen)
        err = split_vs_dense(model, cache, tokens, torch.arange(prefix, prefix + T), None)
        assert err <= TOL, f"{T}-token chunk after {prefix} tokens: {err:.2e}"


def test_32k_prefix_split_equals_dense_mask(tiny_qwen2: Path) -> None:
    model = load_model(tiny_qwen2)
    gen = torch.Generator().manual_seed(32)
    P = 32768
    tree = random_tree(256, gen, model.args.vocab_size, chain=0.3)
    cache = random_cache(model, P, 256, gen)
    assert split_vs_dense(model, cache, tree.tokens, tree.positions(P), tree.ancestor_mask()) <= TOL
    chunk = torch.randint(0, model.args.vocab_size, (48,), generator=gen)
    assert split_vs_dense(model, cache, chunk, torch.arange(P, P + 48), None) <= TOL


@pytest.mark.parametrize("window", [1, 2, 5, 16, 100])
def test_sliding_window_split_equals_dense_mask(tiny_mistral: Path, window: int) -> None:
    """The prefix part windowed (dropped keys, the masked band, the unmasked rest), trees and chunks deeper
    than the window (the tree part windowed too), and prefixes on both sides of the window."""
    model = with_window(load_model(tiny_mistral), window)
    gen = torch.Generator().manual_seed(window)
    for prefix in sorted({0, 3, window - 1, window, window + 1, 40, 700} - {-1}):
        for n, chain in [(1, 0.0), (9, 0.5), (40, 0.95), (100, 0.1)]:
            tree = random_tree(n, gen, model.args.vocab_size, chain)
            cache = random_cache(model, prefix, n, gen)
            err = split_vs_dense(model, cache, tree.tokens, tree.positions(prefix), tree.ancestor_mask())
            assert err <= TOL, f"window {window}, {n}-node tree after {prefix}: {err:.2e}"
            err = split_vs_dense(model, cache, tree.tokens, torch.arange(prefix, prefix + n), None)
            assert err <= TOL, f"window {window}, {n}-token chunk after {prefix}: {err:.2e}"


@pytest.mark.parametrize("window", [None, 3, 50])
def test_draft_shaped_pass_split_equals_dense_mask(tiny_mistral: Path, window: int | None) -> None:
    """A draft pass: b frontier nodes over K >= b scratch slots (their processed ancestors), with the tree
    keys' positions given for a window narrower than K."""
    model = with_window(load_model(tiny_mistral), window)
    gen = torch.Generator().manual_seed(7)
    for prefix in (0, 2, 60):
        tree = random_tree(30, gen, model.args.vocab_size, chain=0.6)
        anc, pos = tree.ancestor_mask(), tree.positions(prefix)
        cache = random_cache(model, prefix, 30, gen)
        with torch.inference_mode():                     # the first 20 nodes were processed by earlier passes
            model(tree.tokens[None, :20], pos[None, :20], TreeMask(prefix, anc[:20, :20]), cache)
        new = torch.arange(20, 30)
        err = split_vs_dense(model, cache, tree.tokens[new], pos[new], anc[new], slots=prefix + new,
                             key_positions=pos)
        assert err <= TOL, f"window {window}, prefix {prefix}: {err:.2e}"


def test_bf16_split_is_close_to_the_dense_mask(tiny_llama: Path) -> None:
    model = load_model(tiny_llama).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    tree = random_tree(40, gen, model.args.vocab_size, chain=0.3)
    cache = random_cache(model, 500, 40, gen, torch.bfloat16)
    assert split_vs_dense(model, cache, tree.tokens, tree.positions(500), tree.ancestor_mask()) < 3e-2


# ------------------------------------------------------------------------------------- the kernels

def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """fp64 softmax attention, K/V repeated per query head; seen bool [T, S]."""
    G = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    scores = (q.double() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ v


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 4])
def test_kernels_agree_with_an_fp64_softmax(kv_heads: int, window: int | None) -> None:
    """cpu (fused), cuda (its layout; on CPU tensors torch's can_use_* checks send it to the plain fallback)
    and math on random parts: prefix, window band with rows that see none of it, tree, causal chunk."""
    gen = torch.Generator().manual_seed(kv_heads)
    H, D = 4, 16
    for P, T, tree in [(0, 6, None), (37, 1, None), (37, 9, None), (200, 12, "tree"), (5, 12, "tree")]:
        q = torch.randn(1, H, T, D, generator=gen)
        k, v = torch.randn(2, 1, kv_heads, P + T + 3, D, generator=gen)
        shape = random_tree(T, gen, 10, 0.5)
        anc = shape.ancestor_mask() if tree else torch.ones(T, T, dtype=torch.bool).tril()
        pos = shape.positions(P) if tree else torch.arange(P, P + T)
        seen = dense_mask(P, anc, pos, pos, window)[0, 0]
        want = reference(q, k[:, :, :P + T], v[:, :, :P + T], seen)
        for kernel in ("cpu", "cuda", "math"):
            plan = build_plan(TreeMask(P, anc if tree else None), pos[None], T, window, H // kv_heads,
                              torch.float32, kernel)
            got = attend(q, k, v, plan)
            assert close(got, want) <= TOL, f"{kernel}: P={P} T={T} {tree}"


# ------------------------------------------------------------------------------------- built once

class OpLog(TorchDispatchMode):
    """Every aten op run: (name, output shapes and dtypes, the flash kernel's key length and mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self.flash: list[tuple[int, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == FLASH_CPU:
            self.flash.append((args[1].shape[2], kwargs.get("attn_mask") is not None))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not func.is_view:
                self.outputs.append((name, tuple(t.shape), t.dtype))
        return out


def logged_forward(model: Transformer, P: int, T: int, dense: bool) -> OpLog:
    gen = torch.Generator().manual_seed(0)
    tree = random_tree(T, gen, model.args.vocab_size, 0.3)
    cache = random_cache(model, P, T, gen)
    pos = tree.positions(P)
    mask = prefix_tree_mask(P, tree.ancestor_mask()) if dense else TreeMask(P, tree.ancestor_mask())
    with torch.inference_mode(), OpLog() as log:
        model(tree.tokens[None], pos[None], mask, cache)
    return log


def test_the_mask_is_built_once_per_forward_never_per_layer_never_over_the_prefix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(write_tiny_model(tmp_path / "deep", "qwen2", seed=9, n_layers=8))
    a = model.args
    G, P, T = a.n_heads // a.n_kv_heads, 1000, 24
    assert G > 1 and T != a.head_dim
    calls = []
    monkeypatch.setattr("specexec.network.model.build_plan", lambda *x, **k: calls.append(1) or build_plan(*x, **k))
    log = logged_forward(model, P, T, dense=False)
    assert len(calls) == 1                                          # one plan per forward, 8 layers
    masks = [o for o in log.outputs if o[1][-2:] == (T, T) and o[2].is_floating_point]
    assert 0 < len(masks) <= 2 < a.n_layers, masks                  # zeros + masked_fill, once
    wide = [o for o in log.outputs if len(o[1]) >= 2 and o[1][-2] in (T, G * T) and o[1][-1] >= P]
    assert wide == []                                               # no mask, no scores over the prefix
    assert not [o for o in log.outputs if len(o[1]) >= 3 and o[1][-3] == a.n_heads and o[1][-2] >= P]  # no K/V repeat
    assert not [o for o in log.outputs if o[0] == "repeat_interleave"]
    # every layer: the prefix in the fused kernel without a mask, the tree's own keys with the small mask
    assert sorted(log.flash) == sorted([(P, False), (T, True)] * a.n_layers)


def test_the_dense_path_is_caught_by_the_same_counters(tmp_path: Path) -> None:
    """The positive control: a dense mask over the prefix is seen by the counters above (and is still built
    only once per forward, in the kernel's GQA layout)."""
    model = load_model(write_tiny_model(tmp_path / "deep", "qwen2", seed=9, n_layers=8))
    P, T = 1000, 24
    log = logged_forward(model, P, T, dense=True)
    wide = [o for o in log.outputs if len(o[1]) >= 2 and o[1][-2] == T and o[1][-1] >= P]
    assert 0 < len(wide) <= 3 < model.args.n_layers                # zeros, ~mask, masked_fill: once
    assert log.flash == [(P + T, True)] * model.args.n_layers


# ------------------------------------------------------------------------------------- the callers

@torch.inference_mode()
def test_engine_and_draft_use_the_split(tiny_pair: tuple[Path, Path]) -> None:
    """Prefill (chunks after a prefix), verification and the draft's passes: every fused-kernel call over
    more keys than a tree or chunk holds runs without a mask."""
    from specexec.builders.specexec import SpecExecBuilder
    from specexec.config import EngineConfig
    from specexec.decoding.engine import Engine

    target, draft = (load_model(p) for p in tiny_pair)
    engine = Engine(target, draft, EngineConfig(budget=16, prefill_chunk=64), SpecExecBuilder())
    prompt = torch.randint(4, target.args.vocab_size, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    with OpLog() as log:
        out = [t for step in engine.generate(prompt, max_new_tokens=12) for t in step]
    assert len(out) == 12
    masked = [keys for keys, has_mask in log.flash if has_mask]
    assert masked and max(masked) <= 64 + 2 * 16 + 1                # chunk or scratch slots, never the prefix
    assert any(keys >= 190 and not has_mask for keys, has_mask in log.flash)


@torch.inference_mode()
def test_draft_forward_with_a_tree_mask_equals_the_dense_mask(tiny_llama: Path) -> None:
    """DraftState.forward: tree_mask [b, K] over scratch slots [L0, L0 + K) gives the logits of the model run
    with the whole dense mask [b, L0 + K] (first L0 columns all True), up to the rounding of the log-sum-exp merge."""
    model = load_model(tiny_llama)
    gen = torch.Generator().manual_seed(5)
    L0 = 12
    tree = random_tree(10, gen, model.args.vocab_size, 0.5)
    anc, pos = tree.ancestor_mask(), tree.positions(L0)
    state = DraftState(model, random_cache(model, L0, 10, gen), cuda_graphs=False)
    new = torch.arange(6, 10)
    state.forward(tree.tokens[:6], pos[:6], anc[:6, :6], L0 + torch.arange(6))
    got = state.forward(tree.tokens[new], pos[new], anc[new], L0 + new)
    dense = torch.cat([torch.ones(4, L0, dtype=torch.bool), anc[new]], 1)
    want = model.logits(model(tree.tokens[new][None], pos[new][None], dense[None, None], state.cache, L0 + new))
    torch.testing.assert_close(got, want, rtol=0, atol=TOL * 10)   # split vs one softmax: rounding only
    assert state.passes == 2


# ------------------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_agree_with_an_fp64_softmax(dtype: torch.dtype) -> None:
    """On the GPU: flash (bf16, unmasked or causal), memory-efficient (fp32, masks, folded GQA) and the plain
    fallback against an fp64 softmax, window band included."""
    gen = torch.Generator().manual_seed(0)
    H, kv, D = 8, 2, 128
    tol = TOL if dtype == torch.float32 else 2e-2
    for P, T, window in [(0, 64, None), (4096, 1, None), (4096, 256, None), (3000, 100, 512), (10, 7, 4)]:
        q = torch.randn(1, H, T, D, generator=gen)
        k, v = torch.randn(2, 1, kv, P + T, D, generator=gen)
        shape = random_tree(T, gen, 10, 0.5)
        anc, pos = shape.ancestor_mask(), shape.positions(P)
        want = reference(q, k, v, dense_mask(P, anc, pos, pos, window)[0, 0])
        for tree in (anc, None):
            if tree is None:
                pos = torch.arange(P, P + T)
                want = reference(q, k, v, dense_mask(P, torch.ones(T, T, dtype=torch.bool).tril(), pos, pos,
                                                     window)[0, 0])
            for kernel in ("cuda", "math"):
                plan = build_plan(TreeMask(P, None if tree is None else tree.cuda()), pos[None].cuda(), T, window,
                                  H // kv, dtype, kernel)
                got = attend(q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype), plan)
                assert close(got.cpu(), want) <= tol, f"{kernel} {dtype}: P={P} T={T} window={window}"


@pytest.mark.gpu
def test_cuda_model_split_equals_dense_mask(tiny_qwen2: Path) -> None:
    model = load_model(tiny_qwen2).cuda()
    gen = torch.Generator().manual_seed(1)
    tree = random_tree(200, gen, model.args.vocab_size, 0.3)
    a = model.args
    cache = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, 8192 + 200, torch.float32, "cuda")
    cache.k.normal_()
    cache.v.normal_()
    cache.length = 8192
    pos = tree.positions(8192).cuda()
    with torch.inference_mode():
        split = model(tree.tokens[None].cuda(), pos[None], TreeMask(8192, tree.ancestor_mask().cuda()), cache)
        dense = model(tree.tokens[None].cuda(), pos[None], prefix_tree_mask(8192, tree.ancestor_mask().cuda()), cache)
    assert close(split, dense) <= TOL
    assert attention.pick_kernel(pos.device) == "cuda"
