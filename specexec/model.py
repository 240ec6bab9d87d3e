"""One Llama-family decoder (Llama 2/3/3.x incl. llama3 rope scaling, Mistral, Qwen2/2.5, Qwen3): pure maths.

`forward(tokens, positions, mask, cache, slots)` serves prefill, one-token decode and tree verification alike:
positions are explicit (tree siblings share one), the mask says which cache slots each token sees (a
`TreeMask`: the whole committed prefix plus a small mask over the new tokens' own slots; or a dense bool
mask), and `slots` says where each token's K/V is written. The mask becomes an `AttentionPlan` once per
forward (the model's sliding window applied there) and every layer attends with it (specexec/attention.py:
prefix and tree attended apart, merged exactly). Parameter names follow the HF checkpoints without the
leading "model." so loading is a rename. `logits(hidden, rows)` computes the LM head only for the rows a
caller needs; callers chunk it (2,048 nodes x 152k vocabulary in fp32 is 1.2 GB).

Does not know: checkpoints, devices, quantization formats (a quantized Linear is swapped in from outside),
offloading (OffloadedTransformer overrides `layer_modules`), trees or sampling.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from specexec.attention import AttentionPlan, TreeMask, attend, build_plan, pick_kernel
from specexec.config import ModelArgs
from specexec.kv.cache import KVCache

LOGIT_CHUNK = 256        # rows of the LM head callers compute at once: 256 x 152k fp32 = 155 MB
_INITS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_")


@contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device (nothing allocated) without running their weight init: every weight is
    loaded, bound or replaced right after. Needed for start-up time, not memory: torch initialises meta tensors
    through its Python reference kernels, whose first use imports torch._dynamo (seconds). nn.init is patched
    only inside the block, so modules built elsewhere at the same time (another thread) would skip their init
    too; callers build from one thread."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    try:
        for name in _INITS:
            setattr(nn.init, name, _leave)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _leave(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] with the checkpoint's rope scaling (default, linear, llama3), computed in
    fp32 on the CPU whatever the default device (callers move them; on meta there would be nothing to read)."""
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d))
    scaling = args.rope_scaling_dict or {}
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


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        d, h, kv = args.head_dim, args.n_heads, args.n_kv_heads
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(args.dim, h * d, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, kv * d, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, kv * d, bias=args.qkv_bias)
        self.o_proj = nn.Linear(h * d, args.dim, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.norm_eps)
            self.k_norm = RMSNorm(d, args.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
                cache: KVCache | None, layer: int, slots: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        if cache is not None:
            cache.write(layer, slots, k, v)
            k, v = cache.view(layer, plan.n_slots)
        out = attend(q, k.to(q.dtype), v.to(q.dtype), plan)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """One decoder layer: pre-norm attention and SwiGLU MLP with residuals."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
                cache: KVCache | None, layer: int, slots: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, plan, cache, layer, slots)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Embedding, decoder blocks, final norm and LM head. See the module docstring for the call contract."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    @property
    def head_weight(self) -> torch.Tensor:
        """[V, D] LM head weight (the embedding when tied and no head module was swapped in; a quantized head's
        dequantized weight, a new tensor)."""
        head = self._modules.get("lm_head")
        if head is None:
            return self.embed_tokens.weight
        return head.weight if isinstance(head, nn.Linear) else head.dequantize()

    def layer_modules(self) -> Iterator[tuple[int, Block]]:
        """(index, block) in order; the offloaded model streams them instead."""
        return enumerate(self.layers)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, head_dim] for `apply_rope`, computed in fp32 then cast:
        (cos f, cos f) and (-sin f, sin f) for the frequencies f = position x inv_freq."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        sin = freqs.sin()
        return (torch.cat((freqs, freqs), -1).cos().unsqueeze(1).to(dtype),
                torch.cat((-sin, sin), -1).unsqueeze(1).to(dtype))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: TreeMask | torch.Tensor | None = None,
                cache: KVCache | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions [B, T]; mask: a TreeMask (prefix = committed cache slots every token sees, tree
        bool [T, K] over the slots that follow), or a dense bool [B, 1, T, S] over cache slots [0, S), or None
        (causal, no cache); slots [T]: where each token's K/V goes (default cache.length + arange(T)). Returns
        hidden [B, T, D] after the final norm. Cache length is NOT advanced here: commit with cache.keep()."""
        if cache is not None:
            if slots is None:
                slots = torch.arange(cache.length, cache.length + tokens.shape[1], device=tokens.device)
            if mask is None:
                raise ValueError("a cached forward needs an explicit mask over the cache slots")
            cache.begin_forward()
        elif isinstance(mask, TreeMask) and mask.prefix:
            raise ValueError(f"a TreeMask with a prefix of {mask.prefix} slots needs the cache holding them")
        x = self.embed_tokens(tokens)
        cos, sin = self.rope(positions, x.dtype)
        plan = self.attention_plan(mask, positions, x.dtype)
        for i, layer in self.layer_modules():
            x = layer(x, cos, sin, plan, cache, i, slots)
        return self.norm(x)

    def new_cache(self, capacity: int, quant: str = "none", tail: int = 0) -> KVCache:
        """A KV cache for this model with `capacity` slots, rows in its dtype on its device (int8 when quant
        says so: lossy). tail: rows of one forward beyond the committed prefix (only streamed layers use it)."""
        a, p = self.args, next(self.parameters())
        return KVCache(a.n_layers, a.n_kv_heads, a.head_dim, capacity, p.dtype, p.device, quant=quant)

    def attention_plan(self, mask: TreeMask | torch.Tensor | None, positions: torch.Tensor,
                       dtype: torch.dtype) -> AttentionPlan:
        """The mask in the form every layer attends with, built once per forward (positions [B, T])."""
        a = self.args
        return build_plan(mask, positions, positions.shape[-1], a.sliding_window, a.n_heads // a.n_kv_heads,
                          dtype, pick_kernel(positions.device))

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., D] -> fp32 logits [R, V] for `rows` of the flattened hidden (all rows when None)."""
        h = hidden.reshape(-1, hidden.shape[-1])
        if rows is not None:
            h = h.index_select(0, rows)
        head = self._modules.get("lm_head")            # a tied model has none, unless a quantized one was set
        return (F.linear(h, self.embed_tokens.weight) if head is None else head(h)).float()


def prefix_tree_mask(n_prefix: int, tree_mask: torch.Tensor, window: int | None = None,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
    """Attention mask [1, 1, T, n_prefix + T] for T new tokens after a committed prefix: all of the prefix
    plus the token's own ancestors `tree_mask` [T, T] (a lower-triangular matrix for a plain sequence).
    With a sliding `window`, keys further back than window - 1 positions are hidden (positions [T] needed)."""
    T = tree_mask.shape[0]
    left = torch.ones(T, n_prefix, dtype=torch.bool, device=tree_mask.device)
    mask = torch.cat([left, tree_mask], dim=1)
    if window is not None and positions is not None:
        key_pos = torch.cat([torch.arange(n_prefix, device=positions.device), positions])
        mask &= (positions.unsqueeze(1) - key_pos.unsqueeze(0)) < window
    return mask.view(1, 1, T, n_prefix + T)


# Optional abilities of a model the engine runs (checked with specexec.abilities.has; a plain Transformer has
# MakesCache only, an offloaded target all four, a wrapped draft such as vocab_trim.TrimmedDraft none).
@runtime_checkable
class MakesCache(Protocol):
    """A model that makes its own KV cache (an offloaded target streams some layers' rows)."""

    def new_cache(self, capacity: int, quant: str = "none", tail: int = 0) -> KVCache: ...


@runtime_checkable
class PlansPrefill(Protocol):
    """A streamed target: one prefill pass streams the whole model, so it takes as many prompt tokens as its
    memory plan allows (`prefill_tokens`)."""

    prefill_tokens: int


@runtime_checkable
class Closes(Protocol):
    """A model with background work to stop (an offloaded target's pager thread)."""

    def close(self) -> None: ...


@runtime_checkable
class Streams(Protocol):
    """A target whose layers a pager streams; `pager.counters()` gives its cumulative streaming counters."""

    pager: Any
