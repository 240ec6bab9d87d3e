"""Read an MXFP4 checkpoint (gpt-oss on the Hub: config.json quantization_config quant_method "mxfp4") as a
checkpoint source of dense tensors, one expert at a time.

The writer (OpenAI's gpt-oss release; transformers' Mxfp4 integration reads the same) stores a fused expert
weight X [E, in, out] (the x @ W layout) as two tensors:
  X_blocks uint8 [E, out, in / 32, 16]   32 FP4 (e2m1) values per block, two per byte, low nibble first
  X_scales uint8 [E, out, in / 32]       one power-of-two scale per block, biased by 127 (e8m0)
value[e, o, 32 g + 2 j]     = FP4[blocks[e, o, g, j] & 15] * 2 ** (scales[e, o, g] - 127)
value[e, o, 32 g + 2 j + 1] = FP4[blocks[e, o, g, j] >> 4] * 2 ** (scales[e, o, g] - 127)
and the dense X is that [E, out, in] transposed to [E, in, out]: the layout of the unquantized checkpoint, so
one weight-name mapping (specexec/families/gpt_oss.py) serves both. Every FP4 value times a power of two is
exact in bfloat16 and float32: dequantizing loses nothing; a layer cache may then quantize to its own format.

`MXFP4Checkpoint` shows each X_blocks/X_scales pair as the dense X (float32) and passes every other tensor
through; get_index(X, e) dequantizes only expert e's blocks.

Does not know: model architectures (a pair is recognised by its suffixes alone), the layer cache, devices.
"""
from __future__ import annotations

import os

import torch

from offload.formats.awq_gptq import stored_dtype
from offload.formats.checkpoint import CheckpointError, SafetensorsCheckpoint

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS, SCALES = "_blocks", "_scales"
SCALE_BIAS = 127
BLOCK = 32                                  # values per scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., out, G, 16], scales uint8 [..., out, G] -> float32 [..., G * 32, out] (transposed)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise CheckpointError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair "
                              f"(blocks [..., G, {BLOCK // 2}], scales [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    out = torch.empty(*b.shape[:-1], BLOCK, dtype=torch.float32)
    out[..., 0::2] = lut[(b & 0x0F).long()]
    out[..., 1::2] = lut[(b >> 4).long()]
    out = torch.ldexp(out, (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1))
    return out.flatten(-2).transpose(-1, -2)


class MXFP4Checkpoint:
    """A safetensors checkpoint whose X_blocks/X_scales pairs read as dense float32 X (see the module docstring)."""

    format = "mxfp4"

    def __init__(self, directory: str | os.PathLike) -> None:
        self.inner = SafetensorsCheckpoint(directory)
        stored = set(self.inner.names())
        self.pairs: dict[str, tuple[str, str]] = {}
        for name in sorted(stored):
            if name.endswith(BLOCKS):
                base = name[: -len(BLOCKS)]
                if base + SCALES not in stored:
                    raise CheckpointError(f"{directory}: MXFP4 tensor {name!r} has no {base + SCALES!r} beside it")
                self.pairs[base] = (name, base + SCALES)
        orphan = next((n for n in sorted(stored) if n.endswith(SCALES) and n[: -len(SCALES)] not in self.pairs), None)
        if orphan is not None:
            raise CheckpointError(f"{directory}: MXFP4 tensor {orphan!r} has no {orphan[:-len(SCALES)] + BLOCKS!r}")
        hidden = {n for pair in self.pairs.values() for n in pair}
        self._names = [n for n in self.inner.names() if n not in hidden] + list(self.pairs)

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.pairs:
            return self.inner.shape(name)
        *lead, rows, groups, _ = self.inner.shape(self.pairs[name][0])
        return (*lead, groups * BLOCK, rows)

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32 if name in self.pairs else stored_dtype(self.inner, name)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.pairs:
            return self.inner.get(name)
        blocks, scales = self.pairs[name]
        return dequantize_mxfp4(self.inner.get(blocks), self.inner.get(scales))

    def get_index(self, name: str, index: int) -> torch.Tensor:
        """tensor[index] (one expert), dequantizing only its blocks."""
        if name not in self.pairs:
            return self.inner.get_index(name, index)
        blocks, scales = self.pairs[name]
        return dequantize_mxfp4(self.inner.get_index(blocks, index), self.inner.get_index(scales, index))
