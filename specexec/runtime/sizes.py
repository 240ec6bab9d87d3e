"""Bytes of each thing a run holds, from config.json alone: a decoder layer packed in a format, a resident
model's weights, KV caches, and the peak transient of one forward pass (its attention included).

Nothing here loads or reads a weight: shapes come from ModelArgs (a Block built on the meta device) and packed
sizes from offload.quant.weights.layer_specs and offload.streaming.storage.plan_layout. The memory ledger
(specexec/runtime/ledger.py) adds these up into a plan.

Does not know: budgets, tiers, plans, what a run consists of (ledger.py and run_shape.py do).
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from offload.quant.linear import kernel_for
from offload.quant.weights import head_format, layer_specs
from offload.streaming.storage import plan_layout

from specexec.config import ModelArgs
from specexec.kv.rows import row_bytes
from specexec.model import Block, on_meta

PREFIX_CHUNK = 256            # CPU: prefix attention is budgeted as query chunks of this many rows


@functools.cache
def block_specs(args: ModelArgs) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], frozenset[str]]:
    """((name, shape) of every tensor of one decoder Block in state_dict order), names of its Linear weights."""
    with on_meta():
        block = Block(args)
    shapes = tuple((n, tuple(t.shape)) for n, t in block.state_dict().items())
    linear = frozenset(f"{path}.weight" for path, m in block.named_modules() if isinstance(m, nn.Linear))
    return shapes, linear


@functools.cache
def layer_bytes(args: ModelArgs, fmt: str, dtype: torch.dtype, device: str = "cpu") -> int:
    """Packed bytes of one decoder layer in `fmt`, packed for `device`'s kernel, as the layer cache and the
    tiers hold it (aligned layout); equal to what offload.cache.store.plan computes from a checkpoint's headers."""
    shapes, linear = block_specs(args)
    specs, meta = layer_specs({n: (dtype, s) for n, s in shapes}, fmt, dtype, linear, device=device)
    return plan_layout(specs, meta).nbytes


@functools.cache
def weight_bytes(args: ModelArgs, fmt: str, dtype: torch.dtype, device: str = "cpu") -> dict[str, int]:
    """Bytes a resident Transformer of `args` holds on `device` with its decoder linears quantized to `fmt`
    (what quantize_module leaves): {"embed", "head" (0 when tied, unless an int8 head is beside it: offload's
    head_format), "norm" (+ RoPE buffer), "layers"}."""
    shapes, linear = block_specs(args)
    specs, _ = layer_specs({n: (dtype, s) for n, s in shapes}, fmt, dtype, linear, device=device)
    per_layer = sum(dt.itemsize * math.prod(shape) for dt, shape in specs.values())
    table = args.vocab_size * args.dim * dtype.itemsize
    head = 0 if args.tie_word_embeddings else table
    if head_format(fmt, device) == "int8":
        head = args.vocab_size * (args.dim + 2)                     # int8 codes and a bf16 scale per row
    return {"embed": table, "head": head,
            "norm": args.dim * dtype.itemsize + args.head_dim // 2 * 4, "layers": args.n_layers * per_layer}


def kv_bytes(args: ModelArgs, slots: int, elem: int, quant: str = "none") -> int:
    """One model's KV cache: K and V of every layer and KV head for `slots` slots (int8: plus the scales)."""
    return args.n_layers * slots * row_bytes(args.n_kv_heads, args.head_dim, elem, quant)


def kv_layer_bytes(args: ModelArgs, slots: int, elem: int, quant: str = "none") -> int:
    """One layer's share of kv_bytes."""
    return slots * row_bytes(args.n_kv_heads, args.head_dim, elem, quant)


def dequant_bytes(args: ModelArgs, context: int, elem: int, quant: str) -> int:
    """The transient K/V of one layer dequantized for attention (int8 caches only; else 0)."""
    return 2 * args.n_kv_heads * context * args.head_dim * elem if quant == "int8" else 0


def attention_bytes(args: ModelArgs, tokens: int, context: int, elem: int, device: str) -> int:
    """Transient bytes of one layer's attention for `tokens` queries over `context` cache slots, for the
    kernels that run: the committed prefix is attended WITHOUT a mask (flash / memory-efficient SDPA never
    builds the H x T x S scores; on CPU budgeted as query chunks of PREFIX_CHUNK rows x context in fp32), the
    tree part with its small [T, T] mask (budgeted as H x T x T scores plus the mask), and the two partial
    results merged by log-sum-exp (two fp32 outputs and their H x T log-sum-exps)."""
    H, T = args.n_heads, tokens
    merge = 2 * T * H * args.head_dim * 4 + 2 * H * T * 4
    tree = H * T * T * elem + T * T * (elem + 1)
    prefix = 0 if device == "cuda" else H * min(T, PREFIX_CHUNK) * context * 4
    return merge + tree + prefix


def forward_bytes(args: ModelArgs, tokens: int, context: int, elem: int, fmt: str, device: str,
                  logit_rows: int, kv_quant: str = "none") -> int:
    """Peak transient bytes of one forward of `tokens` rows over `context` slots: the residual stream, norm
    outputs (and RMSNorm's fp32 copies), q/k/v before and after RoPE, the attention output, the MLP's gate,
    up and product, the attention (attention_bytes), one dequantized weight (when the format's kernel on
    `device` dequantizes: quant.kernel_for) and `logit_rows` rows of fp32 logits with their processed copy;
    with an int8 cache, one layer's dequantized K/V."""
    T, D, I = tokens, args.dim, args.intermediate_size
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    hidden = T * (4 * D + 2 * (q + 2 * kv) + q + 3 * I) * elem + 2 * T * D * 4 + 2 * T * args.head_dim * elem
    dequant = max(I, q) * D * elem if fmt != "none" and kernel_for(fmt, device) == "dequantize" else 0
    logits = min(T, logit_rows) * args.vocab_size * 4 * 2
    return (hidden + attention_bytes(args, T, context, elem, device) + dequant + logits
            + dequant_bytes(args, context, elem, kv_quant))
