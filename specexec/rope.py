"""Rotary position embedding: inverse frequencies with the checkpoint's scaling, and its application to q/k.

Does not know: which layers use which RoPE (specexec/model.py picks per layer), positions' origin, caches.
"""
from __future__ import annotations

import math

import torch

from specexec.config import ModelArgs


def rope_names(args: ModelArgs) -> tuple[str, ...]:
    """The RoPEs the layers of `args` use (LayerKind.rope: "global", and "local" where sliding layers have their
    own), each a table the model keeps and computes once per forward."""
    return tuple(sorted({kind.rope for kind in args.layer_kinds} | {"global"}))


def rope_inv_freq(args: ModelArgs, rope: str = "global") -> torch.Tensor:
    """Inverse frequencies [head_dim/2] of one of the model's RoPEs ("global" | "local", ModelArgs.rope_params)
    with its scaling (default, linear, llama3), computed in fp32 on the CPU whatever the default device
    (callers move them; on meta there would be nothing to read)."""
    d = args.head_dim
    theta, scaling = args.rope_params(rope)
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_ctx / low, inv / factor, torch.where(wavelen < old_ctx / high, inv, mid))
    return inv


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos, sin [B, 1, T, D] from `Transformer.rope` (sin with its first half negated).
    HF's rotate-half, x * cos + cat(-x2, x1) * sin, in four ops instead of seven: cat(x2, x1) is x rolled by
    half, and the sign moves onto sin. Bit for bit the same: a product's sign does not change its magnitude."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
