"""Per-layer attention kinds (ModelArgs.layer_types): sliding-window layers alternating with full ones, each kind
with its own attention plan (built once per forward per kind, never per layer) and RoPE table, against
transformers' own implementation of the same tiny checkpoint (fp32): chunked prefill past the window, one-token
decode, a tree whose paths run past the window, and the no-cache path. The self-draft's layer subset keeps
each layer's kind."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from specexec.network.attention import build_plan
from specexec.config import LayerKind
from specexec.network.model import TreeMask
from specexec.checkpoints.loading import load_model
from specexec.tree import TokenTree
from tests.network.model_reference import TOL, hf_model, new_cache, prefill
from tests.tiny_models import write_tiny_model

WINDOW = 5
ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
PARENTS = [-1, 0, 1, 2, 3, 4, 5, 1, 7, 8, 0]        # two chains longer than the window, one short branch


@pytest.fixture(scope="module")
def alternating(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3, 4 layers: sliding (window 5), full, sliding, full."""
    return write_tiny_model(tmp_path_factory.mktemp("kinds") / "qwen3-alt", "qwen3", seed=21, n_layers=4,
                            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
                            layer_types=ALTERNATING)


def test_the_kinds_are_read_from_config_json(alternating: Path) -> None:
    args = load_model(alternating).args
    assert args.layer_types == tuple(ALTERNATING)
    assert args.layer_kinds == (LayerKind(WINDOW), LayerKind(), LayerKind(WINDOW), LayerKind())
    assert args.subset([1, 2]).layer_types == ("full_attention", "sliding_attention")


@torch.inference_mode()
def test_alternating_windows_match_transformers(alternating: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ours, ref = load_model(alternating), hf_model(alternating)
    ids = torch.randint(7, ours.args.vocab_size, (23,), generator=torch.Generator().manual_seed(3))
    want = ref(ids[None]).logits[0]
    calls: list[int | None] = []
    monkeypatch.setattr("specexec.network.model.build_plan", lambda *a, **k: calls.append(a[3]) or build_plan(*a, **k))
    cache = new_cache(ours)
    got = torch.cat([prefill(ours, cache, ids[a:b]) for a, b in [(0, 9), (9, 16), (16, 17), (17, 23)]])
    assert (got - want).abs().max() < TOL
    assert sorted(calls, key=str) == sorted([None, WINDOW] * 4, key=str)      # one plan per kind per forward
    assert (ours.logits(ours(ids[None], torch.arange(23)[None])) - want).abs().max() < TOL   # no cache
    full = load_model(alternating)
    full.args = dataclasses.replace(full.args, layer_types=("full_attention",) * 4)
    assert full.args.layer_kinds == (LayerKind(),) * 4                        # the control: no window at all
    assert (full.logits(full(ids[None], torch.arange(23)[None])) - want).abs().max() > 1e-2


@torch.inference_mode()
def test_a_tree_past_the_window_equals_each_path(alternating: Path) -> None:
    ours, ref = load_model(alternating), hf_model(alternating)
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(7, ours.args.vocab_size, (12,), generator=g)
    tree = TokenTree.from_lists(torch.randint(7, 300, (len(PARENTS),), generator=g).tolist(), PARENTS)
    cache = new_cache(ours)
    prefill(ours, cache, prompt)
    L = cache.length
    got = ours.logits(ours(tree.tokens[None], tree.positions(L)[None], TreeMask(L, tree.ancestor_mask()), cache))
    for node in range(len(PARENTS)):
        path = torch.cat([prompt, tree.tokens[tree.path(node)]])
        assert (got[node] - ref(path[None]).logits[0, -1]).abs().max() < TOL, node


def test_a_dense_mask_cannot_serve_two_windows(alternating: Path) -> None:
    ours = load_model(alternating)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="need a TreeMask"):
        ours(torch.tensor([[8, 9, 10]]), torch.arange(3)[None], mask)


def test_streamed_kv_of_sliding_layers_moves_the_window_only(alternating: Path, tmp_path: Path) -> None:
    """Greedy through an offloaded target whose every layer's KV streams with it (prompt and answer far past
    the window, chunks and trees) equals target-only decoding of the resident model; the sliding layers stage
    at most WINDOW - 1 committed rows per pass, so the pass moves less than the full layers' rows twice."""
    from offload.cache.store import LayerCache
    from specexec.builders.specexec import SpecExecBuilder
    from specexec.config import EngineConfig
    from specexec.decoding.engine import Engine
    from specexec.kv.rows import row_bytes
    from specexec.checkpoints.loading import read_args
    from specexec.checkpoints.naming import layer_names
    from specexec.runtime.offloaded import build_offloaded

    args = read_args(alternating)
    cache = LayerCache.open_or_build(alternating, layer_names(alternating, args), "none", torch.float32,
                                     cache_root=tmp_path, progress=False)
    ids = torch.randint(7, 300, (17,), generator=torch.Generator().manual_seed(5)).tolist()
    resident = load_model(alternating)
    want = [t for s in Engine(resident, None, EngineConfig(budget=1), None).generate(ids, 20) for t in s]
    draft = load_model(write_tiny_model(tmp_path / "draft", perturb=0.01, base=alternating, seed=6))
    model = build_offloaded(alternating, args, cache, ["ram"] * 4, torch.device("cpu"), torch.float32,
                            kv_streamed=(0, 1, 2, 3))
    try:
        engine = Engine(model, draft, EngineConfig(budget=6, prefill_chunk=7), SpecExecBuilder(), context=48)
        assert [t for s in engine.generate(ids, 20) for t in s] == want
        kv = engine._caches[0].stream
        row = row_bytes(args.n_kv_heads, args.head_dim, 4)
        passes = model.pager.stats.passes
        assert kv.moved_in + kv.topped_up < passes * (2 * (len(ids) + 20) + 2 * (WINDOW - 1)) * row
        assert kv.moved_in + kv.topped_up > passes * 2 * (WINDOW - 1) * row
    finally:
        model.close()
