"""Bytes of each thing a run holds, from config.json alone: a decoder layer packed in a format, a resident
model's weights, KV caches, and the peak transient of one forward pass (its attention included); and the
bytes a built module holds (module_bytes).

Nothing here loads or reads a weight: shapes come from ModelArgs (a Block built on the meta device:
specexec.checkpoints.naming.block_specs) and packed
sizes from offload.quant.weights.layer_specs and offload.streaming.storage.plan_layout. The memory ledger
(specexec/planning/ledger.py) adds these up into a plan.

Does not know: budgets, tiers, plans, what a run consists of (ledger.py and run_shape.py do).
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from offload.quant.linear import kernel_for
from offload.quant.weights import head_format, layer_specs
from offload.streaming.storage import LayerLayout, plan_layout

from specexec.checkpoints.naming import expert_regions, form_specs, layer_form
from specexec.config import ModelArgs
from specexec.network.mixers import cache_bytes, pass_bytes
from specexec.network.model import LOGIT_CHUNK



def layer_bytes(args: ModelArgs, fmt: str, dtype: torch.dtype, device: str = "cpu", layer: int = 0) -> int:
    """Packed bytes of decoder layer `layer` in `fmt`, packed for `device`'s kernel, as the layer cache and the
    tiers hold it (aligned layout); equal to what offload.cache.store.plan computes from a checkpoint's headers.
    Layers of one form (naming.layer_form: dense or routed, their attention's shape, ...) have one size."""
    return _layout(args, fmt, dtype, device, layer_form(args, layer)).nbytes


@functools.cache
def _layout(args: ModelArgs, fmt: str, dtype: torch.dtype, device: str, form: int) -> LayerLayout:
    """The packed layout of decoder layer `form` (a layer_form) of `args` (a routed one: one region per expert)."""
    shapes, linear = form_specs(args, form)
    specs, meta = layer_specs({n: (dtype, s) for n, s in shapes}, fmt, dtype, linear, device=device)
    return plan_layout(specs, meta, expert_regions(args, form))


def expert_split(args: ModelArgs, fmt: str, dtype: torch.dtype, device: str = "cpu", layer: int = 0
                 ) -> tuple[int, int]:
    """(bytes of the dense part, bytes of one routed expert) of decoder layer `layer` packed in `fmt`: the part
    a streamed pass always copies (norms, attention, router, a shared expert) and each expert's region (all of
    one size); (layer_bytes, 0) for a dense layer. dense + n_experts x expert = layer_bytes."""
    lay = _layout(args, fmt, dtype, device, layer_form(args, layer))
    return lay.dense_nbytes, (lay.regions[0].nbytes if lay.regions else 0)


def layer_sizes(args: ModelArgs, fmt: str, dtype: torch.dtype, device: str = "cpu") -> tuple[int, ...]:
    """layer_bytes of every decoder layer, in order."""
    return tuple(layer_bytes(args, fmt, dtype, device, i) for i in range(args.n_layers))


@functools.cache
def weight_bytes(args: ModelArgs, fmt: str, dtype: torch.dtype, device: str = "cpu") -> dict[str, int]:
    """Bytes a resident Transformer of `args` holds on `device` with its decoder linears quantized to `fmt`
    (what quantize_module leaves): {"embed", "head" (0 when tied, unless an int8 head is beside it: offload's
    head_format), "norm" (+ RoPE buffer), "per_layer" (Gemma 4's per-layer input table, projection and norm: 0
    without), "layers"}."""
    per_form = {}
    for form in {layer_form(args, i) for i in range(args.n_layers)}:
        shapes, linear = form_specs(args, form)
        specs, _ = layer_specs({n: (dtype, s) for n, s in shapes}, fmt, dtype, linear, device=device)
        per_form[form] = sum(dt.itemsize * math.prod(shape) for dt, shape in specs.values())
    table = args.vocab_size * args.dim * dtype.itemsize
    head = 0 if args.tie_word_embeddings else table
    if head_format(fmt, device) == "int8":
        head = args.vocab_size * (args.dim + 2)                     # int8 codes and a bf16 scale per row
    width = args.n_layers * args.ple_dim
    per_layer = (args.ple_vocab * width + width * args.dim + args.ple_dim) * dtype.itemsize
    return {"embed": table, "head": head, "per_layer": per_layer,
            "norm": args.dim * dtype.itemsize + args.head_dim // 2 * 4,
            "layers": sum(per_form[layer_form(args, i)] for i in range(args.n_layers))}


def kv_bytes(args: ModelArgs, slots: int, elem: int, quant: str = "none", nodes: int = 0) -> int:
    """One model's cache for `slots` slots, each layer by its mixer kind (network/mixers.py cache_bytes): K and
    V of every KV head per slot for attention layers (int8: plus the scales); a linear-attention layer's states
    and its scratch for passes of up to `nodes` slots past the prefix."""
    return cache_bytes(args, slots, elem, quant, nodes=nodes)


def kv_layer_bytes(args: ModelArgs, slots: int, elem: int, quant: str = "none", layer: int = 0) -> int:
    """Decoder layer `layer`'s share of kv_bytes."""
    return cache_bytes(args, slots, elem, quant, (layer,))


def dequant_bytes(args: ModelArgs, context: int, elem: int, quant: str) -> int:
    """The transient K/V of one layer dequantized for attention (int8 caches only; else 0)."""
    return 2 * args.n_kv_heads * context * args.head_dim * elem if quant == "int8" else 0


def forward_bytes(args: ModelArgs, tokens: int, context: int, elem: int, fmt: str, device: str,
                  logit_rows: int, kv_quant: str = "none", tree: bool = True) -> int:
    """Peak transient bytes of one forward of `tokens` rows over `context` slots: the residual stream, norm
    outputs (and RMSNorm's fp32 copies), q/k/v before and after RoPE, the attention output, the MLP's gate,
    up and product, the token mixer's pass, one dequantized weight (when the format's kernel on
    `device` dequantizes: quant.kernel_for) and `logit_rows` rows of fp32 logits with their processed copy;
    with an int8 cache, one layer's dequantized K/V. An MoE layer (specexec/network/moe.py) counts its widest MLP (the
    dense one, an expert's over all T rows, the shared expert's), the router's fp32 scores, the top-k pairs
    sorted by expert and the output it accumulates. Each kind of token mixer the model's layers have says its
    pass's bytes (network/mixers.pass_bytes; `tree`: a tree pass, else a causal prefill chunk): the widest is
    counted."""
    T, D, I = tokens, args.dim, args.intermediate_size
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    routed = 0
    if args.moe is not None:
        m = args.moe
        I = max(I if m.dense_layers else 0, m.expert_dim, m.shared_dim)
        routed = T * (2 * m.n_experts * 4 + m.top_k * 3 * 8) + T * D * (elem + 4)
    gated = q if args.attn_output_gate else 0                                     # q_proj's output gate
    hidden = T * (4 * D + 2 * (q + gated + 2 * kv) + q + 3 * I) * elem + 2 * T * D * 4 + 2 * T * args.head_dim * elem
    hidden += routed
    dequant = max(I, q) * D * elem if fmt != "none" and kernel_for(fmt, device) == "dequantize" else 0
    logits = min(T, logit_rows) * args.vocab_size * 4 * 2
    mixer = pass_bytes(args, T, context, elem, device, tree)          # the widest kind of layer's
    return hidden + mixer + dequant + logits + dequant_bytes(args, context, elem, kv_quant)


def activation_bytes(args: ModelArgs, tokens: int, context: int, elem: int, fmt: str, device: str = "cpu") -> int:
    """Peak transient bytes of one target pass over `tokens` rows and `context` slots (forward_bytes with one
    LM-head chunk of logits)."""
    return forward_bytes(args, tokens, context, elem, fmt, device, LOGIT_CHUNK)


def module_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer a built module holds (quantized layers count their packed parts)."""
    tensors = list(model.parameters()) + [b for b in model.buffers() if b is not None]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
