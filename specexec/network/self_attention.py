"""The attention kind of token mixer: self-attention with RoPE over a KV cache (full or sliding window; the
layer's window and RoPE table come in with the per-forward plan and cos/sin, ModelArgs.layer_kind).

Its cache is K/V rows per slot (specexec/kv/cache.py): a tree pass writes every node's row at its slot and the
mask shows each node its ancestors' rows only; `keep(slots)` gathers the accepted rows, no weights needed.

Does not know: trees, which family a model is (its ModelArgs options say: fused q/k/v, q/k norms, clipping,
sinks, partial rotary), quantization (a quantized Linear is swapped in from outside).
"""
from __future__ import annotations

import torch
from torch import nn

from specexec.config import ModelArgs
from specexec.kv.cache import KVCache
from specexec.network.attention import AttentionPlan, attend
from specexec.network.norms import RMSNorm
from specexec.network.rope import apply_rope


class Attention(nn.Module):
    """Self-attention with RoPE over a KV cache: q/k/v projections (or one fused qkv_proj), optional q/k
    RMSNorm (per head, or over the whole projection) and q/k/v clipping, RoPE on the first rope_dim dimensions
    of each head, the plan's split attention (with per-head sinks where the model has them), o_proj. With an
    output gate (ModelArgs.attn_output_gate: Qwen3-Next, Qwen3.5) q_proj yields [q, gate] per head and the
    attention output is multiplied by sigmoid(gate) before o_proj.
    Decoder layer `layer`'s own shape (ModelArgs.attn_shape: Gemma 4's full layers have theirs); values from the
    key projection where ModelArgs.global_k_eq_v says so, RMS-normalised per head without a weight with v_norm;
    a layer that shares an earlier layer's K/V (ModelArgs.kv_source) has no k/v projections and attends to that
    layer's rows. `in_dim`: the width q/k/v read (default the model's; an EAGLE-3 head's attention reads
    [embedding; state], 2 D wide)."""

    def __init__(self, args: ModelArgs, layer: int = 0, in_dim: int | None = None) -> None:
        super().__init__()
        width = in_dim or args.dim
        h = args.n_heads
        kv, d = args.attn_shape(layer)
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, d
        self.gated = args.attn_output_gate
        self.source_of = args.kv_source                        # decoder layer -> the layer whose K/V it reads
        k_eq_v = args.global_k_eq_v and args.layer_kind(layer).window is None
        own = args.kv_source(layer) == layer
        if args.fused_qkv:
            self.qkv_proj = nn.Linear(width, (h + 2 * kv) * d, bias=args.qkv_bias)
        else:
            self.q_proj = nn.Linear(width, h * d * (2 if self.gated else 1), bias=args.qkv_bias)
            if own:
                self.k_proj = nn.Linear(width, kv * d, bias=args.qkv_bias)
            if own and not k_eq_v:
                self.v_proj = nn.Linear(width, kv * d, bias=args.qkv_bias)
        self.o_proj = nn.Linear(h * d, args.dim, bias=args.o_bias)
        if args.qk_norm:                  # over each head, or over the whole projection (qk_norm_per_head False)
            self.q_norm = RMSNorm(d if args.qk_norm_per_head else h * d, args.norm_eps, args.norm_plus_one)
            if own:
                self.k_norm = RMSNorm(d if args.qk_norm_per_head else kv * d, args.norm_eps, args.norm_plus_one)
        self.v_norm = RMSNorm(d, args.norm_eps, weight=False) if args.v_norm and own else None
        self.norm_per_head, self.clip = args.qk_norm_per_head, args.clip_qkv
        if args.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(h))

    def project(self, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """x [B, T, D] -> q [B, T, H, hd], k and v [B, T, H_kv, hd] (None for a layer sharing another's K/V),
        q/k normed and q/k/v clipped as configured, and the output gate [B, T, H * hd] (None without one)."""
        B, T, _ = x.shape
        h, kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        gate = None
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split((h * d, kv * d, kv * d), dim=-1)
        else:
            q = self.q_proj(x)
            k = self.k_proj(x) if hasattr(self, "k_proj") else None
            v = self.v_proj(x) if hasattr(self, "v_proj") else k      # values from the key projection
        if self.gated:
            q, gate = q.view(B, T, h, 2 * d).chunk(2, dim=-1)
            q, gate = q.reshape(B, T, h * d), gate.reshape(B, T, h * d)
        normed = hasattr(self, "q_norm")
        if normed and not self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)                                  # over the projection
        q = q.view(B, T, h, d)
        if k is not None:
            k, v = k.view(B, T, kv, d), v.view(B, T, kv, d)
        if normed and self.norm_per_head:
            q = self.q_norm(q)                                                     # per head
            k = self.k_norm(k) if k is not None else None
        if self.v_norm is not None:
            v = self.v_norm(v)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        return q, k, v, gate

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
                cache: KVCache | None, layer: int, slots: torch.Tensor | None) -> torch.Tensor:
        q, k, v, gate = self.project(x)
        return self.output(self.attention_rows(q, k, v, cos, sin, plan, cache, layer, slots), gate)

    def output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The attention's output rows out [B, T, H * hd] (and the gate, when the layer has one) -> o_proj's
        [B, T, D]: row by row."""
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))

    def attention_rows(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cos: torch.Tensor,
                       sin: torch.Tensor, plan: AttentionPlan, cache: KVCache | None, layer: int,
                       slots: torch.Tensor | None) -> torch.Tensor:
        """project's q [B, T, H, hd], k and v [B, T, H_kv, hd] (None: the layer reads another's K/V) -> the
        attention's output rows [B, T, H * hd] before the gate and o_proj: RoPE, the rows written to the cache at
        `slots`, the plan's split attention over the cache. A forest pass (specexec/batching/) calls it once per
        request with that request's rows, cos/sin, plan and cache."""
        B, T = q.shape[:2]
        q = apply_rope(q.transpose(1, 2), cos, sin)
        if k is not None:
            v = v.transpose(1, 2)
            k = apply_rope(k.transpose(1, 2), cos, sin)
        if cache is not None:
            if k is not None:
                cache.write(layer, slots, k, v)
            k, v = cache.view(layer if k is not None else self.source_of(layer), plan.n_slots)
        elif k is None:
            raise ValueError(f"layer {layer} attends to layer {self.source_of(layer)}'s K/V: it needs the cache "
                             "holding them")
        out = attend(q, k.to(q.dtype), v.to(q.dtype), plan, getattr(self, "sinks", None))
        return out.transpose(1, 2).reshape(B, T, -1)
