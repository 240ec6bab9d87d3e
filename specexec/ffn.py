"""The dense feed-forward of a decoder layer: a gated MLP (SwiGLU), also each expert of a sparse layer.

Does not know: attention, routing (specexec/moe.py builds its experts from GatedMLP), quantization (a
quantized Linear is swapped in from outside).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specexec.config import ModelArgs


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))). act "silu": silu(g) * u; "clamped_swiglu" (gpt-oss's experts): g clamped
    above at `limit`, u to [-limit, limit], then (u + 1) * g * sigmoid(alpha * g)."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, activation: str = "silu",
                 alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.activation, self.alpha, self.limit = activation, alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D]."""
        g, u = self.gate_proj(x), self.up_proj(x)
        if self.activation == "silu":
            return self.down_proj(F.silu(g) * u)
        g = g.clamp(max=self.limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((u + 1) * (g * torch.sigmoid(g * self.alpha)))


class MLP(GatedMLP):
    """The dense SwiGLU feed-forward of ModelArgs.intermediate_size (biases with mlp_bias)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args.dim, args.intermediate_size, bias=args.mlp_bias)
