"""Per-channel symmetric 8-bit weights: on the CPU for specexec's integer kernels (cpu_kernels/, which
read this layout as it is), on CUDA for torch's int8 weight-only kernel (aten._weight_int8pack_mm) where it exists.

A weight [out, in] gets one bf16 scale per output channel, s = max|w| / 127, and int8 codes q = round(w / s) in
[-127, 127]: w ~ q * s. Parts: ".qdata" int8 [out, in], ".scale" bf16 [out]. Weight meta: {"format": "int8",
"shape", "dtype", "scheme": "per-channel"}.

The CPU kernel takes fp32 or bf16 activations, quantizes them to int8 per block of 64 (cpu_kernels.ops) and
accumulates in fp32 in a fixed order per output: a row's result does not depend on the other rows (tests check it
bit for bit). On CUDA torch's kernel (bf16 in and out) is used where this torch build has one (`cuda_kernel`);
otherwise, and wherever a caller needs row-exact results on CUDA, the weight is dequantized.

Does not know: modules, layers, files, formats other than its own.
"""
from __future__ import annotations

import functools

import torch

from cpu_kernels import ops as cpu_ops

SCHEME = "per-channel"


def specs(shape: tuple[int, int]) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict]:
    """({suffix: (dtype, shape)}, meta extras) of a weight [out, in], from its shape."""
    out_f, in_f = shape
    return {".qdata": (torch.int8, (out_f, in_f)), ".scale": (torch.bfloat16, (out_f,))}, {"scheme": SCHEME}


def quantize(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """weight [out, in] (any float dtype, any device) -> ({".qdata", ".scale"}, meta extras); codes are chosen
    against the bf16-rounded scale."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-10).to(torch.bfloat16)
    q = (w / scale.float().unsqueeze(1)).round_().clamp_(-127, 127).to(torch.int8)
    return {".qdata": q.contiguous(), ".scale": scale.contiguous()}, {"scheme": SCHEME}


@functools.cache
def cuda_kernel() -> bool:
    """Whether this torch build registers _weight_int8pack_mm for CUDA."""
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", "CUDA"))
    except (AttributeError, RuntimeError):
        return False


def matmul(x: torch.Tensor, parts: dict[str, torch.Tensor], bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] (contiguous) @ W.T (+ bias) -> [M, out]. CPU: x fp32 or bf16, the result in x's dtype
    (cpu_kernels.ops.q8_linear); CUDA: torch's kernel, x bf16, the result bf16, bias added after."""
    if x.device.type != "cuda":
        return cpu_ops.q8_linear(x, parts[".qdata"], parts[".scale"], bias)
    y = torch.ops.aten._weight_int8pack_mm(x, parts[".qdata"], parts[".scale"])
    return y if bias is None else y + bias.to(y.dtype)


def dequantize(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] in `dtype`: q * s (exact in fp32)."""
    return (parts[".qdata"].float() * parts[".scale"].float().unsqueeze(1)).to(dtype)
