"""Broken mixture-of-experts checkpoints through the real command line, as test_bad_checkpoints.py does for
dense ones: ONE line `error: ...` naming the checkpoint's own tensor, exit code 2, no traceback, and nothing
written under the layer-cache root, on the resident, the streamed (`--offload ssd`) and the `convert` paths.

Cases: an expert missing (Qwen3-MoE's per-expert tensors, Mixtral's w1/w2/w3), an expert too many, a router
of the wrong shape, a fused gpt-oss expert tensor holding another number of experts, an MXFP4 pair with a half
missing, a GLM router's score bias missing, GGUF files whose merged expert tensors (llama.cpp's ffn_*_exps) are
a layout we do not read, and config.json routing fields that contradict each other (one line naming the field).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.reliability.checks import assert_nothing_cached, assert_one_line_error, checkpoint_argv, copy_checkpoint

pytestmark = pytest.mark.timeout(120)


def _rewrite(path: Path, change: Callable[[dict], None]) -> Path:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


EXPERT = "model.layers.0.mlp.experts.5.up_proj.weight"
ROUTER = "model.layers.2.mlp.gate.weight"
MIXTRAL_W2 = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
FUSED = "model.layers.0.mlp.experts.down_proj"
SCORE_BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"

# name -> (fixture, break it, words the one line must contain)
CASES: dict[str, tuple[str, Callable[[Path], Path], tuple[str, ...]]] = {
    "missing expert": ("tiny_qwen3_moe", lambda p: _rewrite(p, lambda t: t.pop(EXPERT)), ("missing tensor", EXPERT)),
    "expert too many": ("tiny_qwen3_moe", lambda p: _rewrite(p, lambda t: t.update(
        {"model.layers.0.mlp.experts.16.gate_proj.weight": torch.zeros(32, 64)})),
        ("unexpected tensor", "model.layers.0.mlp.experts.16.gate_proj.weight")),
    "router of the wrong shape": ("tiny_qwen3_moe", lambda p: _rewrite(p, lambda t: t.update(
        {ROUTER: torch.zeros(17, 64)})), (ROUTER, "[17, 64]", "[16, 64]")),
    "missing Mixtral w2": ("tiny_mixtral", lambda p: _rewrite(p, lambda t: t.pop(MIXTRAL_W2)),
                           ("missing tensor", MIXTRAL_W2)),
    "fused experts of another count": ("tiny_gpt_oss", lambda p: _rewrite(p, lambda t: t.update(
        {FUSED: t[FUSED][:7].contiguous()})), (FUSED, "[7, 32, 64]", "8 experts")),
    "MXFP4 pair half missing": ("tiny_gpt_oss_mxfp4", lambda p: _rewrite(p, lambda t: t.pop(FUSED + "_scales")),
                                (FUSED + "_blocks", "_scales")),
    "GLM score bias missing": ("tiny_glm4_moe", lambda p: _rewrite(p, lambda t: t.pop(SCORE_BIAS)),
                               ("missing tensor", SCORE_BIAS)),
}


@pytest.mark.parametrize("mode", ["generate", "offload", "convert"])
@pytest.mark.parametrize("case", list(CASES))
def test_broken_moe_checkpoint_is_one_line_and_caches_nothing(case, mode, cli, cache_root, tmp_path, request):
    fixture, breaker, needles = CASES[case]
    model = breaker(copy_checkpoint(request.getfixturevalue(fixture), tmp_path / "ckpt"))
    assert_one_line_error(cli(*checkpoint_argv(mode, model, cache_root)), *needles)
    assert_nothing_cached(cache_root, tmp_path / "xdg-cache")


@pytest.mark.parametrize("fixture,tensor", [("tiny_qwen3_moe", "blk.0.ffn_gate_up_exps.weight"),
                                            ("tiny_llama", "blk.0.ffn_gate_exps.weight")],
                         ids=["fused-gate-up-experts", "experts-without-expert_count"])
def test_gguf_with_merged_experts_we_do_not_read(fixture, tensor, cli, cache_root, tmp_path, request):
    """Merged experts in a layout we do not read: gate and up fused in one merged tensor (a qwen3moe file), or
    merged experts in a 'llama' file that declares no expert_count: refused with the tensor named, before
    anything is cached."""
    pytest.importorskip("gguf")
    from tests.offload.formats.gguf_writer import write_gguf

    path = write_gguf(request.getfixturevalue(fixture), tmp_path / "merged.gguf",
                      extra={tensor: np.zeros((4, 128, 64), dtype=np.float32)})
    for mode in ("generate", "convert"):
        assert_one_line_error(cli(*checkpoint_argv(mode, path, cache_root)), tensor)
    assert_nothing_cached(cache_root, tmp_path / "xdg-cache")


# config.json edits of the tiny GLM-4.5 (16 experts in 4 groups, top-4 from the best 2) -> words of the line
ROUTING = {
    "topk_group above n_group": ({"topk_group": 5}, ("topk_group 5", "n_group 4")),
    "more experts per token than reachable": ({"num_experts_per_tok": 9}, ("num_experts_per_tok 9", "8 experts")),
    "groups that do not split the experts": ({"n_group": 3, "topk_group": 1}, ("n_routed_experts 16", "n_group 3")),
    "more experts per token than experts": ({"n_group": 1, "topk_group": 1, "num_experts_per_tok": 17},
                                            ("num_experts_per_tok 17", "16 experts")),
}


def test_a_latent_rank_the_tensors_do_not_have_is_one_line_naming_the_tensor(cli, cache_root, tmp_path,
                                                                           tiny_deepseek_v3):
    """config.json's kv_lora_rank 24 where the checkpoint's latent is 32 wide: the first tensor it shapes."""
    import json

    model = copy_checkpoint(tiny_deepseek_v3, tmp_path / "ckpt")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "kv_lora_rank": 24}))
    assert_one_line_error(cli(*checkpoint_argv("generate", model, cache_root)), "self_attn.kv_a_proj_with_mqa",
                          "[40, 64]", "[32, 64]")
    assert_nothing_cached(cache_root, tmp_path / "xdg-cache")


@pytest.mark.parametrize("case", list(ROUTING))
def test_contradicting_routing_fields_are_one_line_naming_the_field(case, cli, cache_root, tmp_path, tiny_glm4_moe):
    import json

    model = copy_checkpoint(tiny_glm4_moe, tmp_path / "ckpt")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, **ROUTING[case][0]}))
    assert_one_line_error(cli(*checkpoint_argv("generate", model, cache_root)), *ROUTING[case][1])
    assert_nothing_cached(cache_root, tmp_path / "xdg-cache")
