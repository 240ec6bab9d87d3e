"""A resident CPU model's decoder layers in one compiled call each (offload/quant/cpu_kernels/block.py) instead of
the torch modules: `fuse_cpu_blocks(model)` gives every qualifying layer a `fast` path, which Block.forward takes
for the passes it can serve and declines (None) for the rest, which then run the modules as before.

A layer qualifies when it is a dense gated-SiLU layer (q/k/v and gate/up fused or not, biases, per-head q/k RMSNorm
allowed; no sandwich norms, Gemma norms, clipping or sinks) whose every linear runs the int4/int8 CPU kernels, with
fp32 norms. A pass is served when it is fp32, one sequence, on a cache whose rows for this layer are fp32 and
resident, and attends row by row (the attention plan carries slot lists: at most ROW_EXACT_T new tokens, full
attention): so prefills of long prompts and windowed layers keep the modules' path.

The kernel's glue sums in another order than torch's ops, so its output equals the modules' up to fp32 rounding.
Hence only a draft is fused (its distribution only has to be the one it samples from); a target keeps the modules,
whose bits every tier and the target-alone decode share.

Does not know: the engine, trees, streamed layers (a layer that is re-bound per pass keeps the modules' path).
"""
from __future__ import annotations

import torch
from torch import Tensor

from offload.quant.cpu_kernels.block import BlockKernel, BlockShape
from offload.quant.cpu_kernels.build import library
from offload.quant.linear import QuantLinear
from specexec.config import ModelArgs
from specexec.kv.cache import KVCache
from specexec.network.attention import AttentionPlan
from specexec.network.ffn import MLP
from specexec.network.model import Block, Transformer
from specexec.network.norms import RMSNorm

_ATTN = (("qkv", "qkv_proj"), ("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj"))
_MLP = (("gate_up", "gate_up_proj"), ("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))


def _linears(block: Block) -> dict[str, QuantLinear] | None:
    """The layer's linears by role, or None when one of them does not run the CPU integer kernels."""
    found = {}
    for parent, names in ((block.self_attn, _ATTN), (block.mlp, _MLP)):
        for role, attr in names:
            mod = parent._modules.get(attr)
            if mod is None:
                continue
            if not isinstance(mod, QuantLinear) or mod.cpu_kernel() is None:
                return None
            found[role] = mod
    return found


def _norms(block: Block) -> dict[str, Tensor] | None:
    attn = block.self_attn
    norms = {"attn": block.input_layernorm, "mlp": block.post_attention_layernorm}
    if hasattr(attn, "q_norm"):
        if not attn.norm_per_head:
            return None
        norms |= {"q": attn.q_norm, "k": attn.k_norm}
    if any(not isinstance(n, RMSNorm) or n.plus_one or n.weight.dtype != torch.float32 for n in norms.values()):
        return None
    return {k: n.weight.detach().contiguous() for k, n in norms.items()}


def _qualifies(block: Block) -> bool:
    attn, mlp = block.self_attn, block.mlp
    return (type(mlp) is MLP and mlp.activation == "silu" and not hasattr(block, "pre_feedforward_layernorm")
            and attn.clip is None and not hasattr(attn, "sinks"))


class FastBlock:
    """Block.forward's fast path for one layer: the compiled layer where the pass allows (module docstring)."""

    def __init__(self, args: ModelArgs, block: Block, linears: dict[str, QuantLinear],
                 norms: dict[str, Tensor]) -> None:
        attn = block.self_attn
        scale = args.attn_scale if args.attn_scale is not None else attn.head_dim ** -0.5
        shape = BlockShape(args.dim, attn.n_heads, attn.n_kv_heads, attn.head_dim, args.rope_dim or attn.head_dim,
                           args.intermediate_size, block.input_layernorm.eps, scale)
        self.modules = linears
        self.bound = {role: m.qdata for role, m in linears.items()}     # re-bound weights: this path steps aside
        self.kernel = BlockKernel(shape, norms, {role: m.cpu_kernel() for role, m in linears.items()})

    def current(self) -> bool:
        return all(m.qdata is self.bound[role] for role, m in self.modules.items())

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, plan: AttentionPlan, cache: KVCache | None,
                 layer: int, slots: Tensor | None) -> Tensor | None:
        """x [1, T, D] -> [1, T, D] (a new tensor), or None when this pass is not one the kernel serves."""
        if (cache is None or plan.rows is None or slots is None or x.dtype != torch.float32 or x.shape[0] != 1
                or cos.dtype != torch.float32 or not self.current()):
            return None
        where, j = cache.where[layer]
        rows = cache.rows
        if where == "streamed" or rows.scale is not None or rows.data.dtype != torch.float32:
            return None
        idx, lens = plan.rows
        T = x.shape[1]
        y = x.reshape(T, -1).clone()
        self.kernel(y, cos.reshape(T, -1).contiguous(), sin.reshape(T, -1).contiguous(), rows.data[j],
                    slots.to(torch.int64).contiguous(), idx, lens)
        return y.view(1, T, -1)


def fuse_cpu_blocks(model: Transformer) -> int:
    """Give each qualifying decoder layer of a resident CPU model its fast path (and the model row-by-row
    attention plans, which carry the slot lists the kernel reads); returns how many layers qualify."""
    if library() is None or next(model.parameters()).device.type != "cpu":
        return 0
    fused = 0
    for block in model.layers:
        linears = _linears(block) if _qualifies(block) else None
        norms = _norms(block) if linears is not None else None
        block.fast = None if norms is None else FastBlock(model.args, block, linears, norms)
        fused += block.fast is not None
    if fused:
        model.row_exact_attention = True
    return fused

