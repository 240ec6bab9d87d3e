"""Rotary position embedding: inverse frequencies with the checkpoint's scaling, and its application to q/k.

Does not know: which layers use which RoPE (specexec/model.py picks per layer), positions' origin, caches.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from specexec.config import ModelArgs


def rope_names(args: ModelArgs) -> tuple[str, ...]:
    """The RoPEs the layers of `args` use (LayerKind.rope: "global", and "local" where sliding layers have their
    own), each a table the model keeps and computes once per forward."""
    return tuple(sorted({kind.rope for kind in args.layer_kinds} | {"global"}))


def rope_inv_freq(args: ModelArgs, rope: str = "global") -> torch.Tensor:
    """Inverse frequencies [head_dim/2] of one of the model's RoPEs ("global" | "local", ModelArgs.rope_params)
    with its scaling (default, linear, llama3, yarn), computed in fp32 on the CPU whatever the default device
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
    elif kind == "yarn":
        inv = _yarn_inv_freq(inv, theta, d, scaling)
    return inv


def _yarn_inv_freq(inv: torch.Tensor, theta: float, d: int, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (Peng et al. 2023): frequencies blended between extrapolated (inv) and interpolated (inv / factor)
    by a linear ramp over the dimensions whose rotations at the original context lie in [beta_slow, beta_fast]."""
    factor, orig = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device="cpu") - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def rope_attention_factor(args: ModelArgs, rope: str = "global") -> float:
    """The factor one RoPE's cos and sin are multiplied by: YaRN's attention temperature (0.1 ln(factor) + 1,
    or the config's attention_factor), else 1."""
    scaling = args.rope_params(rope)[1] or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos, sin [B, 1, T, D] from `Transformer.rope` (sin with its first half negated).
    HF's rotate-half, x * cos + cat(-x2, x1) * sin, in four ops instead of seven: cat(x2, x1) is x rolled by
    half, and the sign moves onto sin. Bit for bit the same: a product's sign does not change its magnitude."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
