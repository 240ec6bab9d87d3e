"""Gemma 4 beyond what every family is tested for (tests/network/test_families.py: logits, trees past the window,
greedy ids resident and on the SSD tier; test_moe.py and test_family_builders.py for its routed block and every
builder):
- the cache holds K/V for the layers that compute their own only, each at its own shape, and the planner
  counts exactly that (the layers reading an earlier layer's K/V add nothing; those rows and the full layers'
  wider ones stay on the device, on a line of their own, where the others stream);
- with every streamed layer's K/V travelling with it, greedy ids are still transformers';
- the published 31B reads as its parameter count; the unsupported uses are one line each.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specexec.checkpoints.catalog import SHIPPED_CONFIGS
from specexec.checkpoints.loading import load_model
from specexec.config import EngineConfig, OffloadConfig
from specexec.families import model_args
from specexec.network.mixers import pinned_rows
from specexec.options import ConfigError
from specexec.planning.sizes import kv_bytes, weight_bytes
from specexec.runtime.assembly import Runtime
from tests.network.model_reference import hf_model
from tests.tiny_models import DRAFT_PERTURB, family_model, write_tiny_model

CONFIGS = SHIPPED_CONFIGS


@pytest.fixture(scope="module")
def gemma4(tiny_root: Path) -> Path:
    return family_model(tiny_root, "gemma4")


def test_the_cache_holds_each_layer_s_own_kv_once(gemma4: Path) -> None:
    """6 layers: 0, 1, 3 sliding (2 KV heads of 16), 2 full (1 KV head of 32); 4 and 5 read 3's and 2's."""
    args = load_model(gemma4).args
    assert [args.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    cache = load_model(gemma4).new_cache(50)
    per_slot = (3 * 2 * 16 + 1 * 32) * 2 * 4                          # K and V, fp32
    assert cache.nbytes == 50 * per_slot == kv_bytes(args, 50, 4)
    assert pinned_rows(args) == {2, 3}                                # the full layer's shape, the read rows


def test_the_plan_keeps_the_pinned_rows_on_the_device(gemma4: Path) -> None:
    from specexec.planning.needs import needs_for
    from specexec.planning.run_shape import RunShape

    args = load_model(gemma4).args
    shape = RunShape(args, None, torch.float32, "cpu", budget=8, context=100, kv_offload="stream")
    needs = needs_for(shape, "none")
    kept = dict(needs.fixed_bytes)["target KV cache (kept)"]
    assert kept == kv_bytes(args, 109, 4) - sum(needs.companion_bytes)   # 100 context + 8 tree + the root
    assert [needs.companion(i) > 0 for i in range(6)] == [True, True, False, False, False, False]
    assert dict(needs.fixed_bytes)["target per-layer inputs"] == weight_bytes(args, "none", torch.float32)[
        "per_layer"] == (320 * 48 + 48 * 64 + 8) * 4


def test_streamed_kv_gives_transformers_greedy_ids(gemma4: Path, tiny_root: Path, tmp_path: Path) -> None:
    ids = torch.randint(7, 300, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        want = hf_model(gemma4).generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                         pad_token_id=0)[0, 9:].tolist()
    draft = write_tiny_model(tiny_root / "gemma4-kv-draft", perturb=DRAFT_PERTURB, base=gemma4, seed=44)
    rt = Runtime.load(str(gemma4), str(draft), EngineConfig(budget=8, dtype="float32"),
                      offload=OffloadConfig(quant="none", offload="ssd", cache_dir=str(tmp_path), kv_offload="stream"))
    try:
        got = [t for step in rt.generate_ids(ids, 16) for t in step]
        cache = rt.engine._caches[0]
        assert cache.streamed_layers == [0, 1]                         # the sliding layers with their own rows
    finally:
        rt.engine.close()
    assert got == want[:len(got)] and (len(got) == 16 or got[-1] in rt.engine.eos_ids)


def test_the_published_31b_reads_as_its_parameter_count() -> None:
    """Shapes as published (60 layers, 5:1 sliding to full, heads of 256 and full ones of 512 with 4 KV heads whose
    values are the keys): 30.7B parameters."""
    args = model_args(json.loads((CONFIGS / "gemma-4-31b-it" / "config.json").read_text()))
    assert (args.family, args.n_layers, args.attn_shape(5), args.attn_shape(0)) == ("gemma4", 60, (4, 512), (16, 256))
    total = sum(weight_bytes(args, "none", torch.bfloat16).values()) / 2
    assert abs(total - 30.7e9) / 30.7e9 < 0.01, total


def test_unsupported_uses_are_one_line(gemma4: Path) -> None:
    cfg = json.loads((gemma4 / "config.json").read_text())
    with pytest.raises(ConfigError, match="bidirectionally"):
        model_args({**cfg, "use_bidirectional_attention": "all"})
    with pytest.raises(ConfigError, match="--draft self is not supported"):
        load_model(gemma4).args.subset([0, 5])
