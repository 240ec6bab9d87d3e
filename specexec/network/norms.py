"""RMSNorm, the normalisation of every decoder in specexec (ModelArgs.norm_plus_one: Gemma's form), and the
per-head RMSNorm gated by SiLU of Gated DeltaNet layers.

Does not know: which family a model is (its options say how to normalise), the rest of the network.
"""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) in fp32, scaled by `weight` after the cast back to x's dtype (Llama), or with plus_one by
    (1 + weight) in fp32 before it (Gemma's checkpoints store weight - 1; its norms round that way); weight False:
    no learned scale at all."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False, weight: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None
        self.eps, self.plus_one = eps, plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is None:                         # a norm without a learned scale (Gemma 4's values)
            return h.to(x.dtype)
        if self.plus_one:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Gated DeltaNet's output norm, per head: x / rms(x) in fp32, cast back, times `weight`, times SiLU(gate) in
    fp32, cast back (Qwen3-Next's and Qwen3.5's RMSNormGated: a plain weight, not 1 + weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [..., dim] -> [..., dim] in x's dtype."""
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (h * torch.nn.functional.silu(gate.float())).to(x.dtype)
