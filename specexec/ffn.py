"""The dense feed-forward of a decoder layer: a gated MLP (SwiGLU, GeGLU; gate and up fused or not).

Does not know: attention, mixtures of experts, quantization (a quantized Linear is swapped in from outside).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specexec.config import ModelArgs


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)); act is ModelArgs.mlp_act (SwiGLU: silu; GeGLU: gelu_tanh). With
    fused_gate_up one gate_up_proj computes [gate; up] (Phi-3: one matmul instead of two)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, inner, bias = args.dim, args.intermediate_size, args.mlp_bias
        if args.fused_gate_up:
            self.gate_up_proj = nn.Linear(dim, 2 * inner, bias=bias)
        else:
            self.gate_proj = nn.Linear(dim, inner, bias=bias)
            self.up_proj = nn.Linear(dim, inner, bias=bias)
        self.down_proj = nn.Linear(inner, dim, bias=bias)
        self.act = ACTIVATIONS[args.mlp_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)
