"""Rotary position embedding: inverse frequencies with the checkpoint's scaling (default, linear, llama3,
YaRN, LongRoPE), the tables a model keeps (global, a sliding layers' local one, LongRoPE's long factors), and its
application to q/k (whole heads, or the first rope_dim dimensions: partial rotary).

Does not know: which layers use which RoPE (specexec/network/model.py picks per layer, and between LongRoPE's short and
long factors), positions' origin, caches.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from specexec.config import ModelArgs


def rope_names(args: ModelArgs) -> tuple[str, ...]:
    """The RoPE tables the model keeps, each computed once per forward: "global"; "local" where sliding layers
    have their own (LayerKind.rope); "long": the global RoPE's LongRoPE long factors (long_switch)."""
    names = {kind.rope for kind in args.layer_kinds} | {"global"}
    return tuple(sorted(names | ({"long"} if long_switch(args) is not None else set())))


def long_switch(args: ModelArgs) -> int | None:
    """For LongRoPE (Phi-3): the original context; a sequence longer than it uses the long factors, as in
    transformers (its generate re-runs the whole context once a generation grows past it). Else None."""
    scaling = args.rope_scaling_dict or {}
    if scaling.get("rope_type") != "longrope":
        return None
    return int(scaling["original_max_position_embeddings"])


def attention_factor(args: ModelArgs, rope: str = "global") -> float:
    """The factor cos and sin of table `rope` are multiplied by: YaRN's attention temperature (the config's
    attention_factor, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) where the config names both,
    else mscale(factor) = 0.1 ln(factor) + 1), LongRoPE's attention factor, else 1."""
    scaling = args.rope_params("global" if rope == "long" else rope)[1] or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":
        return float(scaling.get("attention_factor", 1.0))
    if kind != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = yarn_factor(args, scaling)
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
    return yarn_mscale(factor)


def yarn_factor(args: ModelArgs, scaling: dict[str, Any]) -> float:
    """YaRN's context factor: the config's, else max_position_embeddings / original_max_position_embeddings."""
    if scaling.get("factor") is not None:
        return float(scaling["factor"])
    return args.max_position_embeddings / float(scaling["original_max_position_embeddings"])


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_inv_freq(args: ModelArgs, rope: str = "global") -> torch.Tensor:
    """Inverse frequencies [rope_dim/2] of one of the model's RoPE tables `rope` (rope_names; ModelArgs.rope_params)
    with its scaling (default, linear, llama3, yarn, longrope short or long factors, Gemma 4's proportional: the
    first partial_rotary_factor of the angles over the whole head, the rest 0), computed in fp32 on the CPU
    whatever the default device (callers move them; on meta there would be nothing to read)."""
    d = args.rope_dim or args.rope_head_dim(rope)
    theta, scaling = args.rope_params("global" if rope == "long" else rope)
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
    elif kind == "proportional":                 # Gemma 4: the first angles rotate, the rest stay (frequency 0)
        angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * d // 2)
        inv = torch.cat((inv[:angles], torch.zeros(d // 2 - angles, device="cpu"))) / float(scaling.get("factor", 1.0))
    elif kind == "yarn":
        inv = _yarn_inv_freq(inv, theta, d, scaling, yarn_factor(args, scaling))
    elif kind == "longrope":
        ext = torch.tensor(scaling["long_factor" if rope == "long" else "short_factor"], dtype=torch.float32,
                           device="cpu")
        if ext.numel() != d // 2:
            raise ValueError(f"longrope has {ext.numel()} factors for {d} rotary dimensions (needs {d // 2})")
        inv = 1.0 / (ext * theta ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d))
    return inv


def _yarn_inv_freq(inv: torch.Tensor, theta: float, d: int, scaling: dict[str, Any], factor: float) -> torch.Tensor:
    """YaRN (Peng et al. 2023): frequencies blended between extrapolated (inv) and interpolated (inv / factor)
    by a linear ramp over the dimensions whose rotations at the original context lie in [beta_slow, beta_fast]."""
    orig = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device="cpu") - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """x [..., R] with rotary pairs interleaved, (0, 1), (2, 3), ... (DeepSeek's rope_interleave) -> the halves
    layout apply_rope rotates, [x0, x2, ..., x1, x3, ...]. Rotating that is transformers' interleaved rotation
    bit for bit (its output is laid out in halves too), so the cached rotary key and the query agree."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos, sin [B, 1, T, R] from `Transformer.rope` (sin with its first half negated), R = D
    or, for a partial rotary embedding (ModelArgs.rope_dim), the first R dimensions rotate and the rest pass.
    HF's rotate-half, x * cos + cat(-x2, x1) * sin, in four ops instead of seven: cat(x2, x1) is x rolled by
    half, and the sign moves onto sin. Bit for bit the same: a product's sign does not change its magnitude."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + x.roll(r // 2, -1) * sin
    rot = x[..., :r]
    return torch.cat((rot * cos + rot.roll(r // 2, -1) * sin, x[..., r:]), -1)
