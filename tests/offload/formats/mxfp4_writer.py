"""Write MXFP4 checkpoints for the tests: a gpt-oss checkpoint's fused expert weights quantized to FP4 (e2m1)
blocks of 32 with power-of-two scales, stored as X_blocks / X_scales as the Hub's gpt-oss checkpoints are
(offload/formats/mxfp4.py reads them), with quantization_config quant_method "mxfp4" in config.json.

Does not know: the runtime; it only writes files.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from offload.formats.mxfp4 import BLOCK, FP4_VALUES, SCALE_BIAS

FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., in, out] (x @ W layout) -> (blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32]):
    each block of 32 inputs scaled by the power of two that brings its largest magnitude to at most 6, each
    value rounded to the nearest FP4 value (ties to the lower code)."""
    rows = w.transpose(-1, -2).float()                                         # [..., out, in]
    blocks = rows.reshape(*rows.shape[:-1], -1, BLOCK)                         # [..., out, G, 32]
    amax = blocks.abs().amax(-1).clamp(min=1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, 127)
    lut = torch.tensor(FP4_VALUES)
    codes = ((blocks / torch.exp2(exp).unsqueeze(-1)).unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exp + SCALE_BIAS).to(torch.uint8).contiguous()


def write_mxfp4(dest: Path, base: Path) -> Path:
    """Copy the gpt-oss checkpoint at `base` into `dest` with its fused expert weights in MXFP4."""
    dest, base = Path(dest), Path(base)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(base, dest)
    tensors = load_file(dest / "model.safetensors")
    for name in [n for n in tensors if n.endswith(FUSED)]:
        blocks, scales = quantize_mxfp4(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dest / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest
