"""The dense feed-forward of a decoder layer: a gated MLP (SwiGLU, GeGLU, gpt-oss's clamped SwiGLU; gate and up
fused or not), also each expert of a sparse layer.

Does not know: attention, routing (specexec/network/moe.py builds its experts from GatedMLP), quantization (a
quantized Linear is swapped in from outside).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specexec.config import ModelArgs

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))). act "silu" / "gelu_tanh" / "gelu": f(g) * u (SwiGLU, GeGLU);
    "clamped_swiglu" (gpt-oss's experts): g clamped above at `limit`, u to [-limit, limit], then
    (u + 1) * g * sigmoid(alpha * g). With `fused` one gate_up_proj computes [gate; up] (Phi-3: one matmul)."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, activation: str = "silu",
                 alpha: float = 1.702, limit: float = 7.0, fused: bool = False) -> None:
        super().__init__()
        if fused:
            self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=bias)
        else:
            self.gate_proj = nn.Linear(dim, hidden, bias=bias)
            self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.act = ACTIVATIONS.get(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D]."""
        if hasattr(self, "gate_up_proj"):
            g, u = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            g, u = self.gate_proj(x), self.up_proj(x)
        if self.act is not None:
            return self.down_proj(self.act(g) * u)
        g = g.clamp(max=self.limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((u + 1) * (g * torch.sigmoid(g * self.alpha)))


class MLP(GatedMLP):
    """The dense feed-forward of ModelArgs.intermediate_size (twice that in decoder layer `layer` when it shares
    K/V and ModelArgs.wide_shared_mlp says so): activation mlp_act, biases with mlp_bias, gate and up fused with
    fused_gate_up."""

    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        wide = args.wide_shared_mlp and args.kv_source(layer) != layer
        super().__init__(args.dim, args.intermediate_size * (2 if wide else 1), bias=args.mlp_bias,
                         activation=args.mlp_act, fused=args.fused_gate_up)
