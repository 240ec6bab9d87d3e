"""MXFP4 checkpoints (gpt-oss): offload/formats/mxfp4.py reads X_blocks/X_scales as the dense fused X, the same
values transformers' own dequantizer gives, one expert at a time; a pair with a half missing is one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload.formats.checkpoint import CheckpointError
from offload.formats.mxfp4 import MXFP4Checkpoint, dequantize_mxfp4
from offload.formats.sources import detect_format, open_source
from tests.reliability.checks import copy_checkpoint

GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


def test_dequantized_like_transformers_and_one_expert_at_a_time(tiny_gpt_oss_mxfp4: Path,
                                                                 tiny_gpt_oss: Path) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    stored = load_file(tiny_gpt_oss_mxfp4 / "model.safetensors")
    blocks, scales = stored[GATE_UP + "_blocks"], stored[GATE_UP + "_scales"]
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    src = open_source(tiny_gpt_oss_mxfp4)
    assert detect_format(tiny_gpt_oss_mxfp4) == "mxfp4" and isinstance(src, MXFP4Checkpoint)
    assert GATE_UP in src.names() and GATE_UP + "_blocks" not in src.names()
    assert torch.equal(src.get(GATE_UP), want) and src.shape(GATE_UP) == tuple(want.shape)
    assert torch.equal(src.get_index(GATE_UP, 3), want[3])
    assert torch.equal(dequantize_mxfp4(blocks, scales).to(torch.bfloat16).float(), want)   # exact in bf16 too
    orig = load_file(tiny_gpt_oss / "model.safetensors")[GATE_UP]
    assert src.shape(GATE_UP) == tuple(orig.shape) and 0.01 < float((want - orig).norm() / orig.norm()) < 0.3


def test_a_half_pair_is_one_line(tiny_gpt_oss_mxfp4: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_gpt_oss_mxfp4, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    del tensors[GATE_UP + "_scales"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{GATE_UP}_blocks' has no '{GATE_UP}_scales'") as e:
        open_source(path)
    assert "\n" not in str(e.value)
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
