"""One dense decoder layer in one call of the compiled kernels (csrc/block.c's sx_block): the glue between a layer's
int4/int8 linears (norms, RoPE, the K/V rows' write, attention, SiLU, residuals) runs in C instead of as ~80 torch
ops, which is most of a small model's one-token decode on a CPU beside the weight bytes.

    BlockShape(dim, heads, kv_heads, head_dim, rope_dim, inter, eps, scale)
    BlockKernel(shape, norms {"attn", "mlp", "q"?, "k"?: fp32 [n]}, linears {"q","k","v" | "qkv", "o",
                "gate","up" | "gate_up", "down": BoundLinear}) -> kernel
    kernel(x [T, dim] fp32, out [T, dim], cos, sin [T, rope_dim] fp32, kv [n, S, 2, 1, kv_heads, head_dim] fp32
           (every layer's cache rows, specexec/kv/rows.py's layout), layer, slots int64 [T], idx int32 [T, L],
           lens int32 [T]) -> out (x's layer output; out may be x)

    BlockStack(kernels) -> stack: layers in order in one call (csrc/block.c's sx_blocks: no Python between them)
    stack(x, out, cos, sin, kv, rows [n] (each layer's index into kv), slots, idx, lens) -> out

The kernel holds the tensors whose pointers it was built with. Its result equals the torch modules' up to fp32
rounding (csrc/block.c's docstring), and is row-exact, like each of its parts.

Does not know: modules or families (specexec/runtime/cpu_blocks.py decides which layers qualify and builds the
arguments), masks (the slot lists come made), any other dtype or KV format.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from cpu_kernels.abi import Block, Linear
from cpu_kernels.build import library
from cpu_kernels.ops import BoundLinear

_p, _i64 = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class BlockShape:
    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_dim: int
    inter: int
    eps: float
    scale: float


def _linear(b: BoundLinear | None) -> Linear:
    if b is None:
        return Linear()
    return Linear(b.codes.data_ptr(), b.scales.data_ptr(), b.bias_ptr, b.n, b.k, 4 if b.kind == "q4" else 8,
                   b.group, b.bias_bf16, 0)


class BlockKernel:
    """One layer's weights bound for sx_block (module docstring)."""

    def __init__(self, shape: BlockShape, norms: dict[str, torch.Tensor], linears: dict[str, BoundLinear]) -> None:
        for name, t in norms.items():
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"the {name} norm's weight must be a contiguous fp32 CPU tensor, got {t.dtype}")
        self.lib = library()
        if self.lib is None:
            raise RuntimeError("the compiled CPU kernels are not available")
        self.shape, self.norms, self.linears = shape, norms, linears       # held: the struct points into them
        s, ptr = shape, (lambda key: norms[key].data_ptr() if key in norms else None)
        self.struct = Block(s.dim, s.heads, s.kv_heads, s.head_dim, s.rope_dim, s.inter, ptr("attn"), ptr("mlp"),
                             ptr("q"), ptr("k"), s.eps, s.scale, int("qkv" in linears), int("gate_up" in linears),
                             _linear(linears.get("qkv", linears.get("q"))), _linear(linears.get("k")),
                             _linear(linears.get("v")), _linear(linears["o"]),
                             _linear(linears.get("gate_up", linears.get("gate"))), _linear(linears.get("up")),
                             _linear(linears["down"]))
        self.ref = ctypes.byref(self.struct)

    def __call__(self, x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                 layer: int, slots: torch.Tensor, idx: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """x [T, dim] -> out [T, dim] (may be x); kv: the cache's rows of every layer [n, S, 2, 1, kv_heads,
        head_dim], this layer's at `layer` (module docstring)."""
        T = x.shape[0]
        rows = kv.data_ptr() + layer * kv.stride(0) * 4
        rc = self.lib.sx_block(self.ref, x.data_ptr(), out.data_ptr(), T, cos.data_ptr(), sin.data_ptr(), rows,
                               kv.stride(1), kv.stride(2), slots.data_ptr(), idx.data_ptr(), lens.data_ptr(),
                               idx.shape[-1], torch.get_num_threads())
        if rc:
            raise RuntimeError(f"sx_block failed ({rc}) on x {list(x.shape)}")
        return out


class BlockStack:
    """Layers' kernels run in order in one call (sx_blocks), each layer's cache rows at its own index of kv; it
    holds the kernels (their structs are what it points to)."""

    def __init__(self, kernels: list[BlockKernel]) -> None:
        if not kernels:
            raise ValueError("a block stack needs at least one layer")
        self.kernels, self.lib = list(kernels), kernels[0].lib
        self.ptrs = (_p * len(kernels))(*(ctypes.addressof(k.struct) for k in kernels))
        self._rows: tuple = ()
        self.offsets = (_i64 * len(kernels))()

    def __call__(self, x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                 rows: tuple[int, ...], slots: torch.Tensor, idx: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """x [T, dim] -> out [T, dim] (may be x) through every layer; layer i's cache rows are kv[rows[i]]."""
        if len(rows) != len(self.kernels):
            raise ValueError(f"{len(rows)} cache rows for {len(self.kernels)} layers")
        key = (kv.stride(0), rows)                   # a cache that grew has another layer stride
        if key != self._rows:
            self.offsets[:] = [j * kv.stride(0) for j in rows]
            self._rows = key
        rc = self.lib.sx_blocks(self.ptrs, self.offsets, len(rows), x.data_ptr(), out.data_ptr(), x.shape[0],
                                cos.data_ptr(), sin.data_ptr(), kv.data_ptr(), kv.stride(1), kv.stride(2),
                                slots.data_ptr(), idx.data_ptr(), lens.data_ptr(), idx.shape[-1],
                                torch.get_num_threads())
        if rc:
            raise RuntimeError(f"sx_blocks failed ({rc}) on x {list(x.shape)}")
        return out
