"""Gemma 2, Gemma 3 (text and the multimodal checkpoint's text decoder) and Phi-3 against transformers' own
implementation of the same tiny random checkpoints (fp32; tests/tiny_models.family_kwargs lists the options
each one sets so that every family difference changes the logits):
- logits of a chunked prefill past the sliding window, a one-token decode, the no-cache path and every path
  of a tree that runs past the window equal transformers';
- the split attention (prefix and tree apart, merged by log-sum-exp) equals one dense softmax with
  attention-logit soft-capping on, for windows and prefixes on both sides (the cap is applied inside each
  part, before the merge; without it the result differs);
- greedy ids equal transformers' `generate`, with a draft and without, resident and `--offload ssd`, with the
  self-draft and through the tree path (the specexec builder)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from specexec.network.attention import TreeMask, attend, build_plan
from specexec.config import EngineConfig, OffloadConfig
from specexec.kv.cache import KVCache
from specexec.runtime.assembly import Runtime
from specexec.network.rope import long_switch
from specexec.checkpoints.loading import load_model
from specexec.tree import TokenTree
from tests.network.model_reference import TOL, hf_model, new_cache, prefill
from tests.tiny_models import TINY_WINDOW, family_model, write_tiny_model

PARENTS = [-1, 0, 1, 2, 3, 4, 5, 6, 1, 8, 0, 10]     # chains past the window, and short branches


def cache_for(model, total: int) -> KVCache:
    """A cache whose rows use the LongRoPE factors transformers uses for a sequence of `total` tokens."""
    cache = new_cache(model)
    switch = long_switch(model.args)
    cache.long_rope = switch is not None and total > switch
    return cache


@torch.inference_mode()
def test_logits_match_transformers(tiny_family: Path) -> None:
    ours, ref = load_model(tiny_family), hf_model(tiny_family)
    ids = torch.randint(7, 300, (25,), generator=torch.Generator().manual_seed(1))
    want = ref(input_ids=ids[None]).logits[0].float()
    cache = cache_for(ours, 25)
    got = torch.cat([prefill(ours, cache, ids[a:b]) for a, b in [(0, 9), (9, 17), (17, 18), (18, 25)]])
    assert (got - want).abs().max() < TOL
    assert (ours.logits(ours(ids[None], torch.arange(25)[None])) - want).abs().max() < TOL      # no cache


@torch.inference_mode()
def test_a_tree_past_the_window_equals_each_path(tiny_family: Path) -> None:
    ours, ref = load_model(tiny_family), hf_model(tiny_family)
    g = torch.Generator().manual_seed(2)
    switch = long_switch(ours.args)
    prompt = torch.randint(7, 300, (10 if switch is None else switch + 1,), generator=g)   # LongRoPE: all long
    tree = TokenTree.from_lists(torch.randint(7, 300, (len(PARENTS),), generator=g).tolist(), PARENTS)
    cache = cache_for(ours, prompt.numel() + 1)
    prefill(ours, cache, prompt)
    L = cache.length
    got = ours.logits(ours(tree.tokens[None], tree.positions(L)[None], TreeMask(L, tree.ancestor_mask()), cache))
    for node in range(len(PARENTS)):
        path = torch.cat([prompt, tree.tokens[tree.path(node)]])
        assert (got[node] - ref(input_ids=path[None]).logits[0, -1]).abs().max() < TOL, node


@torch.inference_mode()
def test_a_trimmed_draft_head_caps_its_logits_too(tiny_root: Path) -> None:
    """VocabTrim keeping every token scores exactly what the Gemma 2 draft's own head scores (capped)."""
    from specexec.tuning.vocab_trim import TrimmedDraft

    model = load_model(family_model(tiny_root, "gemma2"))
    hidden = model(torch.tensor([[9, 10, 11]]), torch.arange(3)[None])
    trimmed = TrimmedDraft(model, torch.arange(model.args.vocab_size))
    assert torch.equal(trimmed.logits(hidden), model.logits(hidden)) and model.logits(hidden).abs().max() < 30


def dense_capped(q, k, v, seen: torch.Tensor, scale: float, cap: float | None) -> torch.Tensor:
    """The reference: one softmax over every key, soft-capped scores, masked by `seen` [T, S]."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q.double() @ k.double().transpose(-1, -2) * scale
    s = torch.tanh(s / cap) * cap if cap is not None else s
    return (s.masked_fill(~seen, float("-inf")).softmax(-1) @ v.double()).float()


@pytest.mark.parametrize("window", [None, 3, 40])
@pytest.mark.parametrize("prefix", [0, 2, 37])
def test_split_attention_with_soft_capping_equals_one_dense_softmax(window: int | None, prefix: int) -> None:
    gen = torch.Generator().manual_seed(prefix + (window or 0))
    H, Hkv, D, cap, scale = 4, 2, 16, 2.0, 24 ** -0.5
    tree = TokenTree.from_lists(list(range(len(PARENTS))), PARENTS)
    T = len(PARENTS)
    pos = tree.positions(prefix)
    q = torch.randn(1, H, T, D, generator=gen) * 3
    k, v = torch.randn(1, Hkv, prefix + T, D, generator=gen) * 3, torch.randn(1, Hkv, prefix + T, D, generator=gen)
    keys = torch.cat([torch.arange(prefix), pos])
    seen = torch.cat([torch.ones(T, prefix, dtype=torch.bool), tree.ancestor_mask()], 1)
    if window is not None:
        seen &= (pos[:, None] - keys[None]) < window
    plan = build_plan(TreeMask(prefix, tree.ancestor_mask(), pos), pos[None], T, window, H // Hkv, torch.float32,
                      "cpu", scale, cap)
    assert plan.kernel == "math" and len(plan.parts) >= (2 if prefix else 1)
    want = dense_capped(q, k, v, seen, scale, cap)
    assert (attend(q, k, v, plan) - want).abs().max() < 1e-5
    uncapped = dataclasses.replace(plan, softcap=None)
    assert (attend(q, k, v, uncapped) - want).abs().max() > 1e-2          # the cap matters here


# ----------------------------------------------------------------------------------------- greedy end to end

N_NEW = 20
F32 = EngineConfig(budget=8, dtype="float32")


def hf_greedy(path: Path, ids: list[int]) -> list[int]:
    ref = hf_model(path)
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    return out[0, len(ids):].tolist()


def greedy(rt: Runtime, ids: list[int]) -> list[int]:
    return [t for step in rt.generate_ids(ids, N_NEW) for t in step]


def same_as_hf(got: list[int], want: list[int], eos: set[int]) -> bool:
    """Equal ids; we stop at an EOS that transformers (told no EOS) runs past."""
    return got == want[:len(got)] and (len(got) == len(want) or got[-1] in eos)


def _draft(tiny_root: Path, target: Path) -> Path:
    """A perturbed copy (relative noise 0.01) of a tiny target: a draft that agrees often, not always."""
    dest = tiny_root / f"{target.name}-draft"
    if not (dest / "config.json").exists():
        write_tiny_model(dest, perturb=0.01, base=target, seed=7)
    return dest


@pytest.mark.parametrize("offload", ["none", "ssd"])
def test_greedy_ids_equal_transformers_generate(tiny_family: Path, tiny_root: Path, tmp_path: Path,
                                                offload: str) -> None:
    """Resident or streamed from the SSD tier (unquantized, so fp32 stays exact); with a perturbed draft
    (specexec trees of 8), without one, and (streamed) with the self-draft over two of the target's layers
    (where its layers run alone: not Gemma 4's E models, whose layers read others' K/V and per-layer inputs)."""
    ids = torch.randint(7, 300, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    assert TINY_WINDOW < len(ids) < len(ids) + N_NEW                      # prompt and answer run past the window
    want = hf_greedy(tiny_family, ids)
    off = OffloadConfig(quant="none", offload=offload, cache_dir=str(tmp_path))
    args = load_model(tiny_family).args
    alone = not (args.kv_shared_layers or args.ple_dim)
    draft = "self:none" if offload == "ssd" and alone else str(_draft(tiny_root, tiny_family))
    rt = Runtime.load(str(tiny_family), draft, F32,
                      offload=dataclasses.replace(off, draft_layers=2) if draft == "self:none" else off)
    try:
        eos = set(rt.engine.eos_ids)
        with_draft = greedy(rt, ids)
        assert same_as_hf(with_draft, want, eos), (with_draft, want)
        assert rt.stats()["steps"] < len(with_draft)                     # trees were accepted, not only roots
        assert same_as_hf(greedy(rt.variant(F32, use_draft=False), ids), want, eos)
    finally:
        rt.engine.close()
    if offload == "ssd":                                                  # and the small draft, streamed
        rt = Runtime.load(str(tiny_family), str(_draft(tiny_root, tiny_family)), F32, offload=off)
        try:
            assert same_as_hf(greedy(rt, ids), want, set(rt.engine.eos_ids))
        finally:
            rt.engine.close()



def test_longrope_prompts_on_both_sides_of_the_switch_in_one_engine(tiny_root: Path) -> None:
    """A prompt longer than the switch runs long from its first row; the next call, shorter again, does not
    reuse those rows (they were computed with the long factors): both equal transformers' generate."""
    from specexec.builders.specexec import SpecExecBuilder
    from specexec.decoding.engine import Engine

    path = family_model(tiny_root, "phi3_long")
    target, draft = load_model(path), load_model(_draft(tiny_root, path))
    engine = Engine(target, draft, EngineConfig(budget=6), SpecExecBuilder())
    gen = torch.Generator().manual_seed(9)
    long_prompt = torch.randint(7, 300, (20,), generator=gen).tolist()
    short_prompt = long_prompt[:10]
    for ids in (long_prompt, short_prompt, long_prompt):
        got = [t for s in engine.generate(ids, 12) for t in s]
        want = hf_greedy(path, ids)[:12]
        assert got == want[:len(got)] and (len(got) == 12 or got[-1] in engine.eos_ids)
    assert engine._caches[0].long_rope


# ----------------------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@torch.inference_mode()
def test_cuda_kernels_compute_what_the_cpu_computes(tiny_family: Path) -> None:
    """fp32 on CUDA (the memory-efficient kernel with query_pre_attn_scalar's scale; soft-capped plans in plain
    maths) equals fp32 on the CPU through a chunked prefill and a tree; bf16 (the flash kernel) stays close."""
    cpu = load_model(tiny_family, "cpu", "float32")
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(7, 300, (11,), generator=g)
    nodes = torch.randint(7, 300, (len(PARENTS),), generator=g).tolist()

    def run(model, device: str) -> torch.Tensor:
        cache = KVCache(model.args.n_layers, model.args.n_kv_heads, model.args.head_dim, 96,
                        next(model.parameters()).dtype, device)
        cache.long_rope = long_switch(model.args) is not None
        first = prefill(model, cache, prompt.to(device))
        L, tree = cache.length, TokenTree.from_lists(nodes, PARENTS, device=device)
        hidden = model(tree.tokens[None], tree.positions(L)[None], TreeMask(L, tree.ancestor_mask()), cache)
        return torch.cat([first, model.logits(hidden)]).float().cpu()

    want = run(cpu, "cpu")
    assert (run(load_model(tiny_family, "cuda", "float32"), "cuda") - want).abs().max() < 1e-3
    bf16 = run(load_model(tiny_family, "cuda", "bfloat16"), "cuda")
    assert ((bf16 - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()) < 0.05


@pytest.mark.gpu
def test_cuda_streamed_kv_greedy_equals_target_only(tiny_family: Path, tiny_root: Path, tmp_path: Path) -> None:
    """fp32 on CUDA, every layer in pinned RAM with its KV rows streamed with it (sliding layers move only their
    window): greedy with the perturbed draft equals target-only decoding on the same device."""
    cfg = EngineConfig(budget=8, dtype="float32", device="cuda")
    off = OffloadConfig(quant="none", offload="ram", kv_offload="stream", cache_dir=str(tmp_path))
    rt = Runtime.load(str(tiny_family), str(_draft(tiny_root, tiny_family)), cfg, offload=off)
    try:
        ids = torch.randint(7, 300, (9,), generator=torch.Generator().manual_seed(3)).tolist()
        got = greedy(rt, ids)
        assert got == greedy(rt.variant(cfg, use_draft=False), ids)
        assert same_as_hf(got, hf_greedy(tiny_family, ids), set(rt.engine.eos_ids))
    finally:
        rt.engine.close()
