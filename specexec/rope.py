"""Rotary position embedding: inverse frequencies with the checkpoint's scaling (default, linear, llama3,
LongRoPE), the tables a model keeps (global, a sliding layers' local one, LongRoPE's long factors), and its
application to q/k (whole heads, or the first rope_dim dimensions: partial rotary).

Does not know: which layers use which RoPE (specexec/model.py picks per layer, and between LongRoPE's short and
long factors), positions' origin, caches.
"""
from __future__ import annotations

import math

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


def attention_factor(args: ModelArgs, rope: str) -> float:
    """The factor cos and sin of table `rope` are multiplied by (LongRoPE's attention factor; 1 otherwise)."""
    _, scaling = args.rope_params("global" if rope == "long" else rope)
    return float((scaling or {}).get("attention_factor", 1.0)) if (scaling or {}).get("rope_type") == "longrope" \
        else 1.0


def rope_inv_freq(args: ModelArgs, rope: str = "global") -> torch.Tensor:
    """Inverse frequencies [rope_dim/2] of one of the model's RoPE tables `rope` (rope_names; ModelArgs.rope_params)
    with its scaling (default, linear, llama3, longrope short or long factors), computed in fp32 on the CPU
    whatever the default device (callers move them; on meta there would be nothing to read)."""
    d = args.rope_dim or args.head_dim
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
    elif kind == "longrope":
        ext = torch.tensor(scaling["long_factor" if rope == "long" else "short_factor"], dtype=torch.float32,
                           device="cpu")
        if ext.numel() != d // 2:
            raise ValueError(f"longrope has {ext.numel()} factors for {d} rotary dimensions (needs {d // 2})")
        inv = 1.0 / (ext * theta ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d))
    return inv


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
