"""CPU decoder layers in one compiled call each (cpu_kernels/block.py) instead of the torch modules:
a qualifying layer module is told a `fast` path (Block.run_as), which Block.forward takes for the passes it can
serve and declines (None) for the rest, which then run the modules as before. `fuse_cpu_blocks(model)` does it for a resident model
(an int4/int8 draft on a CPU); an offloaded target of the CPU integer kernels gives each layer module its path
when the pager first hands it out (runtime/offloaded.py), and a slot's module rebuilds the kernel's pointers on the
first pass after each re-bind.

When every layer has its path and all attend alike, the model is also told a whole-stack path (FastStack, as
its Execution.stack): the whole decoder stack in one call (csrc/block.c's sx_blocks), which Transformer.decode
takes for the passes every layer would serve: no Python between layers (docs/algorithms.md §27). A
resident draft (fuse_cpu_blocks) and an offloaded target whose plan keeps every layer resident get it; a target
that streams any layer keeps the pager's layer-by-layer path. fuse_cpu_blocks also joins a draft's q/k/v into one
qkv_proj and gate/up into one gate_up_proj (new tensors; the kernels compute each output row alone, so the bits are
the same): one activation quantization and one threaded call where there were three and two.

A layer qualifies when it is a dense gated-SiLU attention layer (q/k/v and gate/up fused or not, biases, per-head q/k
RMSNorm allowed; no sandwich norms, Gemma norms, clipping, sinks or output gate; no other mixer kind) whose every linear runs the int4/int8 CPU kernels, with
fp32 norms (an MoE model's dense layers too). A pass is served when it is fp32, one sequence, on a cache whose
rows for this layer are fp32 and resident, and attends row by row (the attention plan carries slot lists: at most
ROW_EXACT_T new tokens, full attention): so prefills of long prompts and windowed layers keep the modules' path.

The kernel sums in another order than torch's ops, so its output equals the modules' up to fp32 rounding. Within
one model every pass it serves is row-exact (a tree row has its one-token bits), and every tier of an offloaded
target takes the same path, so the target alone and speculative decoding still give the same tokens.

Does not know: the engine, trees, which tier a layer's bytes came from.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import chain
from dataclasses import replace
from operator import is_

import torch
from torch import Tensor

from cpu_kernels.block import BlockKernel, BlockShape, BlockStack
from cpu_kernels.build import library
from offload.quant.linear import QuantLinear
from specexec.config import ModelArgs
from specexec.kv.cache import KVCache
from specexec.network.attention import AttentionPlan
from specexec.network.ffn import MLP
from specexec.network.model import Block, Transformer
from specexec.network.norms import RMSNorm
from specexec.network.self_attention import Attention

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
    attn, mlp = block.mixer, block.mlp
    return (type(attn) is Attention and not attn.gated and type(mlp) is MLP and mlp.activation == "silu"
            and not hasattr(block, "pre_feedforward_layernorm") and attn.clip is None and not hasattr(attn, "sinks"))


class FastBlock:
    """Block.forward's fast path for one layer module: the compiled layer where the pass allows (module
    docstring). A module re-pointed at other weights (a streamed layer's slot, QuantLinear.bind) gets its kernel
    rebuilt on its next pass, from the tensors it then holds."""

    def __init__(self, args: ModelArgs, block: Block) -> None:
        attn = block.self_attn
        scale = args.attn_scale if args.attn_scale is not None else attn.head_dim ** -0.5
        self.shape = BlockShape(args.dim, attn.n_heads, attn.n_kv_heads, attn.head_dim,
                                args.rope_dim or attn.head_dim, args.intermediate_size, block.input_layernorm.eps,
                                scale)
        self.block, self.kernel, self.key = block, None, ()
        mods = [*attn.children(), *block.mlp.children(), block.input_layernorm, block.post_attention_layernorm]
        self.dicts = [d for m in mods for d in (m._parameters, m._buffers)]    # where a re-bind puts new tensors

    def _tensors(self) -> tuple:
        """The tensors the kernel points into, compared by identity (a re-bind replaces them): read from the
        modules' own dicts, ~40x cheaper than .parameters() on every pass."""
        return tuple(chain.from_iterable(d.values() for d in self.dicts))

    def _bind(self) -> bool:
        """Point the kernel at the module's current tensors; False when they no longer run the CPU kernels."""
        key = self._tensors()
        if self.kernel is not None and len(key) == len(self.key) and all(map(is_, key, self.key)):
            return True
        linears, norms = _linears(self.block), _norms(self.block)
        if linears is None or norms is None:
            self.kernel = None
            return False
        self.kernel = BlockKernel(self.shape, norms, {role: m.cpu_kernel() for role, m in linears.items()})
        self.key = key
        return True

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, plan: AttentionPlan, cache: KVCache | None,
                 layer: int, slots: Tensor | None) -> Tensor | None:
        """x [1, T, D] -> [1, T, D] (a new tensor), or None when this pass is not one the kernel serves."""
        if not _serves(x, cos, plan, cache, slots):
            return None
        where, j = cache.where[layer]
        if where == "streamed" or not self._bind():
            return None
        args = _pass_args(plan, cos, sin, slots)
        T = x.shape[1]
        out = torch.empty(T, x.shape[2], dtype=torch.float32)
        self.kernel(x.reshape(T, -1).contiguous(), out, args[0], args[1], cache.rows.data, j, *args[2:])
        return out.view(1, T, -1)


class FastStack:
    """Transformer.decode's fast path for a resident model whose every layer has a FastBlock: the whole decoder
    stack in one compiled call (BlockStack: no Python between layers) where the pass
    is one every layer serves, else None (the layers then run one by one, each with its own path)."""

    def __init__(self, layers: Sequence[Block]) -> None:
        self.layers, self.blocks = layers, [block.fast for block in layers]
        self.kernels, self.stack = (), None

    def _bind(self) -> BlockStack | None:
        """The stack of the layers' current kernels (rebuilt when one was re-bound); None when one no longer runs
        the CPU kernels, or the model's layers are no longer the ones the stack was made for."""
        if len(self.layers) != len(self.blocks) or not all(map(is_, (b.fast for b in self.layers), self.blocks)):
            return None
        if not all(fb._bind() for fb in self.blocks):
            return None
        kernels = tuple(fb.kernel for fb in self.blocks)
        if len(kernels) != len(self.kernels) or not all(map(is_, kernels, self.kernels)):
            self.kernels, self.stack = kernels, BlockStack(list(kernels))
        return self.stack

    def __call__(self, x: Tensor, ropes: dict[str, tuple[Tensor, Tensor]], plans: dict[int | None, AttentionPlan],
                 cache: KVCache | None, slots: Tensor | None) -> Tensor | None:
        """x [1, T, D] -> the last layer's output [1, T, D] (a new tensor, before the final norm), or None."""
        if len(ropes) != 1 or len(plans) != 1 or None not in plans:
            return None
        cos, sin = next(iter(ropes.values()))
        plan = plans[None]
        if not _serves(x, cos, plan, cache, slots):
            return None
        rows = []
        for where, j in cache.where[: len(self.blocks)]:
            if where == "streamed":
                return None
            rows.append(j)
        stack = self._bind()
        if stack is None or len(rows) != len(self.blocks):
            return None
        cos_t, sin_t, *lists = _pass_args(plan, cos, sin, slots)
        T = x.shape[1]
        out = torch.empty(T, x.shape[2], dtype=torch.float32)
        stack(x.reshape(T, -1).contiguous(), out, cos_t, sin_t, cache.rows.data, tuple(rows), *lists)
        return out.view(1, T, -1)


def _serves(x: Tensor, cos: Tensor, plan: AttentionPlan, cache: KVCache | None, slots: Tensor | None) -> bool:
    """Whether the compiled layers serve this pass (module docstring), short of each layer's own rows' tier."""
    if (cache is None or plan.rows is None or slots is None or x.dtype != torch.float32 or x.shape[0] != 1
            or cos.dtype != torch.float32):
        return False
    rows = cache.rows
    return rows.scale is None and rows.data.dtype == torch.float32


_last = threading.local()           # one forward's arguments, shared by its layers


def _pass_args(plan: AttentionPlan, cos: Tensor, sin: Tensor, slots: Tensor) -> tuple[Tensor, ...]:
    """(cos, sin [T, R] contiguous, slots int64 [T], idx, lens) made once per forward, not once per layer: kept
    while the plan is the same object (Transformer.decode builds one per forward; nothing writes these tensors
    between its layers)."""
    key = (plan, cos, sin, slots)
    hit = getattr(_last, "key", ())
    if len(hit) != len(key) or any(a is not b for a, b in zip(hit, key)):
        T = slots.shape[-1]
        _last.key, _last.args = key, (cos.reshape(T, -1).contiguous(), sin.reshape(T, -1).contiguous(),
                                      slots.to(torch.int64).contiguous(), *plan.rows)
    return _last.args


def compilable(block: Block) -> bool:
    """Whether a layer module has a shape the kernel covers and weights that run the CPU kernels."""
    return library() is not None and _qualifies(block) and _linears(block) is not None and _norms(block) is not None


def fast_block(args: ModelArgs, block: Block) -> FastBlock | None:
    """The fast path of a compilable layer module, else None."""
    return FastBlock(args, block) if compilable(block) else None


def _joined(mods: list[QuantLinear]) -> QuantLinear | None:
    """One QuantLinear computing [mods[0]; mods[1]; ...] (their weights, scales and biases stacked by output row:
    new tensors; the pieces are then freed), or None when the pieces differ in format, group, input or bias. The
    kernels compute each output row on its own, so the stacked layer gives each row the bits it had alone."""
    first = mods[0]
    meta = {k: v for k, v in first.wmeta.items() if k != "shape"}
    for m in mods:
        if ({k: v for k, v in m.wmeta.items() if k != "shape"} != meta or m.in_features != first.in_features
                or m.has_bias != first.has_bias or m.parts().keys() != first.parts().keys()):
            return None
    out = sum(m.out_features for m in mods)
    joined = QuantLinear(first.in_features, out, first.has_bias, first.fmt, first.dtype, first.row_exact)
    parts = {s: torch.cat([m.parts()[s] for m in mods]) for s in first.parts()}
    bias = torch.cat([m.bias for m in mods]) if first.has_bias else None
    joined.set_parts(parts, {**first.wmeta, "shape": [out, first.in_features]}, bias)
    return joined


def _join_projections(block: Block) -> None:
    """q/k/v into one qkv_proj and gate/up into one gate_up_proj (the layouts Phi-3's checkpoints have, which
    Attention and GatedMLP run as such): a resident layer then quantizes its input once and starts one threaded
    kernel where it started three and two (docs/algorithms.md §27)."""
    for parent, names, joined_name in ((block.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                                       (block.mlp, ("gate_proj", "up_proj"), "gate_up_proj")):
        mods = [parent._modules.get(n) for n in names]
        if all(isinstance(m, QuantLinear) for m in mods):
            joined = _joined(mods)
            if joined is not None:
                for n in names:
                    delattr(parent, n)
                setattr(parent, joined_name, joined)


def fuse_cpu_blocks(model: Transformer) -> int:
    """Give each qualifying decoder layer of a resident CPU model its fast path, its projections joined
    (_join_projections), and the model row-by-row attention plans, which carry the slot lists the kernel reads,
    and, when every layer qualifies, the whole stack's fast path; returns how many layers qualify."""
    if library() is None or next(model.parameters()).device.type != "cpu":
        return 0
    paths: list[FastBlock | None] = []
    for block in model.layers:
        ok = compilable(block)
        if ok:
            _join_projections(block)
        paths.append(FastBlock(model.args, block) if ok else None)
    fused = sum(path is not None for path in paths)
    row_exact = model.execution.row_exact or fused > 0
    for block, path in zip(model.layers, paths):
        block.run_as(path, row_exact)
    model.run_as(replace(model.execution, row_exact=row_exact, stack=fast_stack(model.args, model.layers)))
    return fused


def fast_stack(args: ModelArgs, layers: Sequence[Block]) -> FastStack | None:
    """The whole-stack fast path over `layers` (every decoder layer, in order), or None unless each has its fast
    path and all attend alike (one RoPE, no sliding window: one attention plan serves them all)."""
    kinds = {(k.rope, k.window) for k in args.layer_kinds}
    if (len(layers) != args.n_layers or any(block.fast is None for block in layers) or len(kinds) != 1
            or next(iter(kinds))[1] is not None):
        return None
    return FastStack(layers)
