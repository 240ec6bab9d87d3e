"""RMSNorm, the normalisation of every decoder in specexec (ModelArgs.norm_plus_one: Gemma's form).

Does not know: which family a model is (its options say how to normalise), the rest of the network.
"""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) in fp32, scaled by `weight` after the cast back to x's dtype (Llama), or with plus_one by
    (1 + weight) in fp32 before it (Gemma's checkpoints store weight - 1; its norms round that way)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.plus_one = eps, plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)
