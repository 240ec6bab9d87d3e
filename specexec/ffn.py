"""The dense feed-forward of a decoder layer: a gated MLP (SwiGLU).

Does not know: attention, mixtures of experts, quantization (a quantized Linear is swapped in from outside).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specexec.config import ModelArgs


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
