"""Attention of T new tokens over a KV cache, split at the committed prefix and merged exactly.

The cache holds a committed prefix in slots [0, P) that every new token sees, then the new tokens' own keys
(a tree's nodes, a prefill chunk, a draft frontier and its processed ancestors) in slots [P, P + K), which each
token sees only where a small mask [T, K] says so. One dense mask over all P + K keys costs a T x (P + K) mask
per layer and the masked kernels; instead each part is attended on its own and the parts are merged with
their log-sum-exps, the algebra of blockwise softmax (FlashAttention, Dao et al. 2022; the prefix/tree split
of LongSpec, Yang et al. 2025):

    out_i, lse_i = attention of q over part i, and the log-sum-exp of its scaled scores   [B, H, T]
    lse = logsumexp_i(lse_i);   out = sum_i exp(lse_i - lse) * out_i

which is the softmax over the union of the parts' keys, up to float rounding (fp32: ~1e-7 relative). With two
parts (the usual prefix + tree) the weights are sigmoid(lse_1 - lse_2) and its complement, so the merge is
out_2 + sigmoid(lse_1 - lse_2) * (out_1 - out_2): six elementwise ops per layer instead of a stacked
log-sum-exp (on a GPU, six kernel launches instead of about twenty).

The parts (`AttentionPlan`, built ONCE per forward by `build_plan`; every layer reuses it):
- prefix [lo, P): no mask at all. lo = 0 unless a sliding window of W positions applies: prefix slot j holds
  position j and every new token's position lies in [P, P + K), so keys below P - W + 1 are hidden from every
  token (dropped), keys from P + K - W on are visible to every token (unmasked), and only the band between
  (at most K - 1 keys) needs a per-row mask: a third part.
- tree [P, P + K): the small additive mask; causal (no mask tensor) for a prefill chunk; windowed when K > W
  (positions of the tree's keys: `TreeMask.tree_positions`, or the tokens' own when K == T).
- a dense bool mask [B, 1, T, S] (today's callers, tests) is one part over [0, S), also converted once.

Kernels: which runs is chosen per device, each returns the log-sum-exp F.scaled_dot_product_attention hides.
- CPU: aten._scaled_dot_product_flash_attention_for_cpu, the kernel SDPA itself picks on CPU (fp32/bf16, with
  or without a mask); it takes H_kv < H natively, so K/V and masks are never repeated per query head, and an
  unmasked part gets the query folded per KV head (each K/V block then serves G heads at once: faster).
- CUDA: aten._scaled_dot_product_flash_attention for fp16/bf16 parts without a mask (GQA native), else
  aten._scaled_dot_product_efficient_attention (fp32, masks); each only where torch's own can_use_* check says
  the inputs fit. The efficient kernel has no GQA: the query is folded to [B, H_kv, G*T, D] (rows g*T + t,
  no K/V copy) and a mask is laid out G-fold and 16-aligned once per forward, as SDPA itself would per call.
- anything else: plain maths (matmul, logsumexp), also the reference the tests compare the kernels against.
A row that sees no key of a part (only possible in the window band) gets lse = -inf and output 0 there.
Scores are scaled by the plan's `scale` (default D ** -0.5; Gemma's query_pre_attn_scalar) in every kernel.
Attention-logit soft-capping (Gemma 2: scores -> cap * tanh(scores / cap)) runs inside each part, before its
log-sum-exp, so the merge stays exact; no fused kernel caps scores, so a capped plan runs plain maths.

Attention sinks (gpt-oss): a learned logit s_h per head that joins every row's softmax as a key with no value.
It enters the denominator once, at the merge, as one more part with output 0 and lse = s_h:
lse = logsumexp(lse_1, ..., lse_n, s_h); out = sum_i exp(lse_i - lse) * out_i. Each part stays a plain kernel
call, and a one-part plan (a one-token decode) is scaled by sigmoid(lse_1 - s_h) the same way.

Does not know: trees, RoPE, the cache layout beyond "k, v [B, H_kv, S, D] for slots [0, S)", checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from cpu_kernels.attend import attend_rows, slot_lists
from specexec.config import ModelArgs

NEG_INF = float("-inf")
CUDA_MASK_ALIGN = 16           # the efficient kernel wants the mask's row stride a multiple of 16 elements
ROW_EXACT_T = 256              # passes up to this many tokens attend row-exactly (build_plan's row_exact)


@dataclass(frozen=True)
class TreeMask:
    """Which cache slots T new tokens see: every committed slot [0, prefix) (within a sliding window, which the
    model applies), plus `tree` bool [T, K] over the slots [prefix, prefix + K) (None: causal over the T new
    tokens themselves, K = T). The tokens' positions must lie in [prefix, prefix + K).
    tree_positions [K]: positions of the tree's keys, only read for a sliding window narrower than K (default:
    the tokens' own positions when K == T; otherwise the tree part is not windowed)."""

    prefix: int
    tree: Tensor | None = None
    tree_positions: Tensor | None = None


@dataclass(frozen=True)
class Part:
    """Keys [start, stop) of the cache, attended with `bias` (additive, in the kernel's layout; None: no mask)
    or top-left `causal`; rows bool [B|1, 1, T]: the tokens that see at least one of these keys (None: all)."""

    start: int
    stop: int
    bias: Tensor | None = None
    causal: bool = False
    rows: Tensor | None = None


@dataclass(frozen=True)
class AttentionPlan:
    """How every layer of one forward attends: the parts over cache slots [0, n_slots) and the kernel."""

    parts: tuple[Part, ...]
    n_slots: int
    kernel: str                  # "cpu" | "cuda" | "math"
    groups: int                  # query heads per KV head (G)
    scale: float | None = None   # score scale (None: D ** -0.5)
    softcap: float | None = None # scores -> softcap * tanh(scores / softcap) inside each part (plain maths)
    rows: tuple[Tensor, Tensor] | None = None   # row-exact slot lists (idx [B|1, T, L], lens [B|1, T]) or None


def pick_kernel(device: torch.device) -> str:
    """'cpu' and 'cuda' have fused kernels that return the log-sum-exp; every other device runs plain maths."""
    return device.type if device.type in ("cpu", "cuda") else "math"


def build_plan(mask: TreeMask | Tensor | None, positions: Tensor, n_new: int, window: int | None, groups: int,
               dtype: torch.dtype, kernel: str, scale: float | None = None,
               softcap: float | None = None, row_exact: bool = False) -> AttentionPlan:
    """The per-forward attention plan. mask: a TreeMask, a dense bool [B, 1, T, S] over slots [0, S), or None
    (no cache: causal over the T new tokens). positions [B, T]; window: the layers' sliding window or None;
    scale: the score scale (None: D ** -0.5); softcap: attention-logit soft-capping (plain maths only: no fused
    kernel caps scores, so the plan's kernel becomes "math"); row_exact: on CPU, a pass of at most ROW_EXACT_T
    tokens without window or cap attends row by row (`row_slots`), bitwise as each token's one-token decode."""
    if softcap is not None:
        kernel = "math"
    plan = _split_plan(mask, positions, n_new, window, groups, dtype, kernel, scale, softcap)
    if row_exact and kernel == "cpu" and window is None and softcap is None and n_new <= ROW_EXACT_T:
        return replace(plan, rows=row_slots(mask, n_new))
    return plan


def row_slots(mask: TreeMask | Tensor | None, n_new: int) -> tuple[Tensor, Tensor]:
    """The slots each new token sees, as cpu_kernels.attend's lists (idx [B|1, T, L], lens [B|1, T]): every
    committed slot, then its tree keys (the TreeMask's tree, causal without one) or the dense mask's row."""
    if isinstance(mask, Tensor):
        return slot_lists(mask[:, 0].cpu())
    tm = mask if mask is not None else TreeMask(0)
    tree = tm.tree.cpu() if tm.tree is not None else torch.ones(n_new, n_new, dtype=torch.bool).tril()
    seen = torch.cat([torch.ones(n_new, tm.prefix, dtype=torch.bool), tree], dim=1)
    return slot_lists(seen[None])


def _split_plan(mask: TreeMask | Tensor | None, positions: Tensor, n_new: int, window: int | None, groups: int,
                dtype: torch.dtype, kernel: str, scale: float | None, softcap: float | None) -> AttentionPlan:
    """The plan of parts merged by their log-sum-exps (the module docstring)."""
    if isinstance(mask, Tensor):
        S = mask.shape[-1]
        return AttentionPlan((Part(0, S, _layout(_additive(mask, dtype), groups, kernel)),), S, kernel, groups,
                             scale, softcap)
    tm = mask if mask is not None else TreeMask(0)
    P = tm.prefix
    K = n_new if tm.tree is None else tm.tree.shape[1]
    if tm.tree is not None and tm.tree.shape[0] != n_new:
        raise ValueError(f"tree mask has {tm.tree.shape[0]} rows for {n_new} new tokens")
    parts = _prefix_parts(P, K, positions, window, groups, dtype, kernel)
    tree = _tree_part(tm, P, K, positions, window, groups, dtype, kernel)
    if tree.causal and n_new == 1 and parts and parts[-1].bias is None and parts[-1].stop == P:
        parts[-1] = Part(parts[-1].start, P + 1)         # one-token decode: the token sees everything, unmasked
    else:
        parts.append(tree)
    return AttentionPlan(tuple(parts), P + K, kernel, groups, scale, softcap)


def _prefix_parts(P: int, K: int, positions: Tensor, window: int | None, groups: int, dtype: torch.dtype,
                  kernel: str) -> list[Part]:
    """Parts over the committed prefix: [lo, hi) with a window band mask (window only), [hi, P) unmasked."""
    if P == 0:
        return []
    lo, hi = (0, 0) if window is None else (min(max(P - window + 1, 0), P), min(max(P + K - window, 0), P))
    parts = []
    if hi > lo:
        key_pos = torch.arange(lo, hi, device=positions.device)
        seen = (positions[:, None, :, None] - key_pos) < window                   # [B, 1, T, hi - lo]
        parts.append(Part(lo, hi, _layout(_additive(seen, dtype), groups, kernel), rows=seen.any(-1)))
    if P > hi:
        parts.append(Part(hi, P))
    return parts


def _tree_part(tm: TreeMask, P: int, K: int, positions: Tensor, window: int | None, groups: int,
               dtype: torch.dtype, kernel: str) -> Part:
    """The new tokens' own keys [P, P + K): causal or the tree mask, windowed where the window is narrower.
    On CUDA with G > 1 a causal part also carries its mask spelled out (a folded query is not top-left causal)."""
    B, T = positions.shape
    key_pos = (tm.tree_positions.view(1, 1, 1, K) if tm.tree_positions is not None
               else positions.view(B, 1, 1, T) if K == T else None)
    windowed = window is not None and K > window and key_pos is not None
    causal = tm.tree is None and not windowed
    if causal and not (kernel == "cuda" and groups > 1):
        return Part(P, P + K, causal=True)
    seen = tm.tree if tm.tree is not None else torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
    seen = seen.view(1, 1, T, K)
    if windowed:
        seen = seen & ((positions.view(B, 1, T, 1) - key_pos) < window)
    return Part(P, P + K, _layout(_additive(seen, dtype), groups, kernel), causal=causal)


def _additive(seen: Tensor, dtype: torch.dtype) -> Tensor:
    """bool [..., T, n] -> 0 where seen, -inf elsewhere, in the run dtype."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, NEG_INF)


def _layout(bias: Tensor, groups: int, kernel: str) -> Tensor:
    """An additive mask [B|1, 1, T, n] in the layout the kernel takes: as is on CPU and for plain maths; on
    CUDA G-fold ([B|1, 1, G*T, n], rows g*T + t like the folded query) with 16-aligned rows."""
    if kernel != "cuda":
        return bias
    B, _, T, n = bias.shape
    folded = bias.repeat(1, 1, groups, 1) if groups > 1 else bias
    width = -(-n // CUDA_MASK_ALIGN) * CUDA_MASK_ALIGN
    padded = folded.new_zeros(B, 1, groups * T, width)
    padded[..., :n] = folded
    return padded[..., :n]


# ----------------------------------------------------------------------------------------------- per layer

def attend(q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan, sinks: Tensor | None = None) -> Tensor:
    """q [B, H, T, D]; k, v [B, H_kv, S >= plan.n_slots, D] (the cache's slots [0, S)) -> out [B, H, T, D].
    sinks [H]: attention-sink logits (see the module docstring), or None."""
    if plan.rows is not None and sinks is None:
        D = q.shape[-1]
        return attend_rows(q, k, v, *plan.rows, D ** -0.5 if plan.scale is None else plan.scale)
    outs, lses = [], []
    for part in plan.parts:
        kp, vp = k[:, :, part.start:part.stop], v[:, :, part.start:part.stop]
        out, lse = attend_part(q, kp, vp, part, plan.kernel, plan.groups, plan.scale, plan.softcap)
        if part.rows is not None:                         # rows that see none of these keys
            lse = lse.masked_fill(~part.rows, NEG_INF)
            out = torch.where(part.rows.unsqueeze(-1), out, 0.0)
        outs.append(out)
        lses.append(lse)
    return merge(outs, lses, sinks)


def merge(outs: list[Tensor], lses: list[Tensor], sinks: Tensor | None = None) -> Tensor:
    """Exact softmax merge: outs [B, H, T, D] each normalised over its own keys, lses [B, H, T] (fp32); with
    sinks [H], each head's sink logit joins the denominator (a part with output 0)."""
    if sinks is None and len(outs) == 1:
        return outs[0]
    if sinks is None and len(outs) == 2:     # the usual prefix + tree: weights sigmoid(l1 - l2) and 1 - that, six ops
        w = torch.sigmoid(lses[0] - lses[1]).unsqueeze(-1)
        second = outs[1].float()
        return (second + w * (outs[0].float() - second)).to(outs[0].dtype)
    if sinks is not None:
        lses = lses + [sinks.float().view(1, -1, 1).expand_as(lses[0])]
    lse = torch.stack(lses).logsumexp(0)
    acc = sum((l - lse).exp().unsqueeze(-1) * o.float() for o, l in zip(outs, lses))
    return acc.to(outs[0].dtype)


def attend_part(q: Tensor, k: Tensor, v: Tensor, part: Part, kernel: str, groups: int, scale: float | None = None,
                softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """One part: (out [B, H, T, D] in q's dtype, lse [B, H, T] fp32) on the plan's kernel. The log-sum-exp is
    of the scaled (and soft-capped) scores, so the parts merge exactly whatever the scale and the cap."""
    if kernel == "cpu":
        return _attend_cpu(q, k, v, part, groups, scale)
    if kernel == "cuda":
        fused = _attend_cuda(q, k, v, part, groups, scale)
        if fused is not None:
            return fused
        bias = part.bias[..., : q.shape[2], :] if part.bias is not None else None   # G-fold rows: the first T
        return attend_math(q, k, v, Part(part.start, part.stop, bias, part.causal and bias is None), scale)
    return attend_math(q, k, v, part, scale, softcap)


def _attend_cpu(q: Tensor, k: Tensor, v: Tensor, part: Part, groups: int,
                scale: float | None) -> tuple[Tensor, Tensor]:
    """The fused CPU kernel. A part without a mask gets the query folded per KV head ([B, H_kv, G*T, D]: every
    K/V block is loaded once for G heads; ~1.3x faster at long prefixes); masked parts use its native GQA."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    B, H, T, D = q.shape
    if part.bias is None and not part.causal and groups > 1:
        out, lse = flash(q.reshape(B, H // groups, groups * T, D), k, v, scale=scale)
        return out.reshape(B, H, T, D), lse.reshape(B, H, T).float()
    out, lse = flash(q, k, v, is_causal=part.causal, attn_mask=part.bias, scale=scale)
    return out, lse.float()


def _attend_cuda(q: Tensor, k: Tensor, v: Tensor, part: Part, groups: int,
                 scale: float | None = None) -> tuple[Tensor, Tensor] | None:
    """Flash (fp16/bf16, no mask or causal, GQA native) or memory-efficient attention (query folded per KV
    head, the plan's G-fold mask); None when torch says neither kernel takes these inputs."""
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    B, H, T, D = q.shape
    if D % 8:
        return None
    if (part.bias is None or part.causal) and q.dtype in (torch.float16, torch.bfloat16) and \
            can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, part.causal, groups > 1)):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, part.causal,
                                                                       scale=scale)[:2]
        return out, lse[..., :T].float()
    Hkv = k.shape[1]
    qf = q.reshape(B, Hkv, groups * T, D) if groups > 1 else q
    bias = None if part.bias is None else part.bias.expand(B, Hkv, groups * T, part.bias.shape[-1])
    causal = part.causal and bias is None
    if not can_use_efficient_attention(SDPAParams(qf, k, v, bias, 0.0, causal, False)):
        return None
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qf, k, v, bias, True, 0.0, causal,
                                                                       scale=scale)[:2]
    return out.reshape(B, H, T, D), lse[..., : groups * T].reshape(B, H, T).float()


def attend_math(q: Tensor, k: Tensor, v: Tensor, part: Part, scale: float | None = None,
                softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """Plain maths, GQA without copies: q folded to [B, H_kv, G, T, D]; bias [B|1, 1, T, n] broadcast; scores
    scaled (default D ** -0.5) and soft-capped (softcap * tanh(s / softcap), before the mask, as transformers)."""
    B, H, T, D = q.shape
    Hkv, n = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, H // Hkv, T, D).float()
    scores = qg @ k.float().transpose(-1, -2).unsqueeze(2) * (D ** -0.5 if scale is None else scale)
    if softcap is not None:                                                     # [B, H_kv, G, T, n]
        scores = torch.tanh(scores / softcap) * softcap
    if part.bias is not None:
        scores = scores + part.bias.float().unsqueeze(2)
    elif part.causal:
        scores = scores.masked_fill(~torch.ones(T, n, dtype=torch.bool, device=q.device).tril(), NEG_INF)
    lse = scores.logsumexp(-1)
    probs = (scores - lse.unsqueeze(-1)).exp().nan_to_num(0.0)
    out = probs @ v.float().unsqueeze(2)
    return out.reshape(B, H, T, D).to(q.dtype), lse.reshape(B, H, T)


PREFIX_CHUNK = 256            # CPU: prefix attention is budgeted as query chunks of this many rows
MATH_COPIES = 3               # fp32 score tensors plain-maths attention holds at once (scores, capped, probs)


def pass_bytes(args: ModelArgs, tokens: int, context: int, elem: int, device: str, tree: bool = True) -> int:
    """Transient bytes of one layer's attention for `tokens` queries over `context` cache slots, for the
    kernels that run: the committed prefix is attended WITHOUT a mask (flash / memory-efficient SDPA never
    builds the H x T x S scores; on CPU budgeted as query chunks of PREFIX_CHUNK rows x context in fp32), the
    tree part with its small [T, T] mask (budgeted as H x T x T scores plus the mask), and the two partial
    results merged by log-sum-exp (two fp32 outputs and their H x T log-sum-exps). With attention-logit
    soft-capping (Gemma 2) no fused kernel runs: both parts hold MATH_COPIES fp32 H x T x keys score tensors."""
    H, T = args.n_heads, tokens
    merge = 2 * T * H * args.head_dim * 4 + 2 * H * T * 4
    tree = H * T * T * elem + T * T * (elem + 1)
    prefix = 0 if device == "cuda" else H * min(T, PREFIX_CHUNK) * context * 4
    if args.attn_softcap is not None:       # soft-capped scores: plain maths over every key (attention.py)
        tree = MATH_COPIES * H * T * T * 4 + T * T * (elem + 1)
        prefix = MATH_COPIES * H * T * context * 4
    return merge + tree + prefix
