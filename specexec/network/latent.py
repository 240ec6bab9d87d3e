"""The latent attention kind of token mixer (multi-head latent attention, MLA: DeepSeek-V2/V3/R1, Kimi-K2;
ModelArgs.latent says its shape): every head's keys and values are expanded from one small latent per token,
and the cache holds only that latent (specexec/kv/latent.py).

Per token: c = RMSNorm((x W_kv_a)[:r]) (r = kv_rank) and a rotary key k_rope = RoPE((x W_kv_a)[r:]) shared by
every head; per head h, kv_b_proj expands c into a key part W_uk_h c (nope_dim) and a value W_uv_h c (v_dim).
The query is q_h = (x W_q)_h (or through the low-rank W_q_a, RMSNorm, W_q_b) split into q_nope_h and q_rope_h.
transformers expands every cached token's key and value per head and attends; this module attends in the
latent space instead ("absorbed"), which is the same function:

    score_h(t, s) = q_nope_h(t) . W_uk_h c(s) + q_rope_h(t) . k_rope(s) = [q_nope_h W_uk_h ; q_rope_h] . [c(s) ; k_rope(s)]
    out_h(t)      = sum_s p_h(t, s) W_uv_h c(s) = W_uv_h (sum_s p_h(t, s) c(s))

so the cached row [c ; k_rope] (kv_rank + rope_dim values) is both the key and, its first kv_rank values, the
value of ONE KV head that all H query heads share: the split prefix/tree attention of specexec/network/
attention.py runs on it unchanged (a GQA group of H), its score scale the model's (qk head dim ** -0.5, times
YaRN's mscale(mscale_all_dim) squared: ModelArgs.attn_scale). In fp32 the result equals transformers' to
rounding (another summation order), never another function; no per-slot expansion, so a pass costs the same
whatever the context's length but for the attention itself.

Does not know: trees, caches beyond "write a row, read the first n", which family it runs (LatentArgs say),
quantization (kv_b_proj's weight is read through `linear_weight`, dequantized when a quantized linear was
swapped in).
"""
from __future__ import annotations

import torch
from torch import nn

from specexec.config import ModelArgs
from specexec.kv.cache import KVCache
from specexec.network.attention import AttentionPlan, attend
from specexec.network.norms import RMSNorm
from specexec.network.rope import apply_rope, deinterleave


class LatentAttention(nn.Module):
    """MLA under transformers' parameter names: q_proj or q_a_proj / q_a_layernorm / q_b_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj (biases on q_a, kv_a and o with attention_bias)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        m = args.latent
        if m is None:
            raise ValueError(f"a latent attention layer needs ModelArgs.latent; this {args.family} config has none")
        h, qk = args.n_heads, m.nope_dim + m.rope_dim
        self.n_heads, self.shape = h, m
        if m.q_rank is None:
            self.q_proj = nn.Linear(args.dim, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(args.dim, m.q_rank, bias=args.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_rank, m.norm_eps)
            self.q_b_proj = nn.Linear(m.q_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(args.dim, m.kv_rank + m.rope_dim, bias=args.qkv_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_rank, m.norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_rank, h * (m.nope_dim + m.v_dim), bias=False)
        self.o_proj = nn.Linear(h * m.v_dim, args.dim, bias=args.o_bias)

    def query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> q_nope [B, H, T, nope_dim], q_rope [B, H, T, rope_dim] (RoPE not applied yet)."""
        B, T, _ = x.shape
        m = self.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, self.n_heads, m.nope_dim + m.rope_dim).transpose(1, 2)
        return q[..., :m.nope_dim], q[..., m.nope_dim:]

    def latent_row(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> the cached row [B, 1, T, kv_rank + rope_dim]: the normed latent, the rotated key."""
        B, T, _ = x.shape
        m = self.shape
        c, k_rope = self.kv_a_proj_with_mqa(x).split((m.kv_rank, m.rope_dim), dim=-1)
        k_rope = k_rope.view(B, 1, T, m.rope_dim)
        k_rope = apply_rope(deinterleave(k_rope) if m.interleaved else k_rope, cos, sin)
        return torch.cat((self.kv_a_layernorm(c).view(B, 1, T, m.kv_rank), k_rope), -1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
                cache: KVCache | None, layer: int, slots: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; cos, sin [B, 1, T, rope_dim] of the layer's RoPE table."""
        B, T, _ = x.shape
        m = self.shape
        q_nope, q_rope = self.query(x)
        q_rope = apply_rope(deinterleave(q_rope) if m.interleaved else q_rope, cos, sin)
        row = self.latent_row(x, cos, sin)
        if cache is not None:
            cache.write(layer, slots, row, None)
            row = cache.view(layer, plan.n_slots)[0].to(x.dtype)
        w = linear_weight(self.kv_b_proj).to(x.dtype).view(self.n_heads, m.nope_dim + m.v_dim, m.kv_rank)
        q = torch.cat((q_nope @ w[:, :m.nope_dim], q_rope), -1)                    # [B, H, T, kv_rank + rope_dim]
        out = attend(q, row, row, plan)[..., :m.kv_rank]                            # [B, H, T, kv_rank]
        out = out @ w[:, m.nope_dim:].transpose(1, 2)                               # [B, H, T, v_dim]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def linear_weight(linear: nn.Module) -> torch.Tensor:
    """The [out, in] weight of a linear layer: an nn.Linear's own, a swapped-in quantized one's dequantized."""
    return linear.weight if isinstance(linear, nn.Linear) else linear.dequantize()
