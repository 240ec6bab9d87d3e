"""The compiled library's interface as ctypes sees it: every exported function's signature (SIGNATURES) and the
structs block.c reads (Linear, Block), mirrored by hand; `check(lib)` compares the mirrors with the layout the
library reports (sx_layout), so a struct edited on one side only fails when the library loads, not in a call.

Does not know: compiling (build.py), what the functions compute (csrc/, ops.py, attend.py, block.py).
"""
from __future__ import annotations

import ctypes

_i64, _i32, _int, _ptr, _f = ctypes.c_int64, ctypes.c_int32, ctypes.c_int, ctypes.c_void_p, ctypes.c_float

SIGNATURES = {      # name -> (restype, argtypes), as csrc/ declares them
    "sx_isa": (ctypes.c_char_p, []),
    "sx_chunk_bytes": (_int, []),
    "sx_layout": (_int, [_ptr, _int]),
    "sx_q4_linear": (_int, [_ptr, _int, _i64, _i64, _ptr, _ptr, _i64, _int, _ptr, _int, _ptr, _int, _int]),
    "sx_q4_quantize": (_int, [_ptr, _int, _i64, _i64, _int, _ptr, _int, _int, _ptr, _ptr, _int]),
    "sx_q8_linear": (_int, [_ptr, _int, _i64, _i64, _ptr, _ptr, _i64, _ptr, _int, _ptr, _int, _int]),
    "sx_read": (ctypes.c_uint64, [_ptr, _i64, _int]),
    "sx_attend_rows": (_int, [_ptr, _ptr, _ptr, _ptr, _int, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr,
                              _ptr, _i64, _i64, _f, _int]),
    "sx_block": (_int, [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _int]),
    "sx_blocks": (_int, [_ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64,
                         _int]),
}


class Linear(ctypes.Structure):
    """block.c's SxLinear: one quantized linear in ops.py's layouts (kind 4: q4, 8: q8)."""
    _fields_ = [("codes", _ptr), ("scales", _ptr), ("bias", _ptr), ("n", _i64), ("k", _i64), ("kind", _i32),
                ("group", _i32), ("bias_bf16", _i32), ("pad", _i32)]


class Block(ctypes.Structure):
    """block.c's SxBlock: one decoder layer's shape, norms and linears."""
    _fields_ = [("dim", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("rope_dim", _i64),
                ("inter", _i64), ("attn_norm", _ptr), ("mlp_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
                ("eps", _f), ("scale", _f), ("fused_qkv", _i32), ("fused_gate_up", _i32),
                *((name, Linear) for name in ("q", "k", "v", "o", "gate", "up", "down"))]


def layout() -> list[int]:
    """What sx_layout reports, as the mirrors have it: sizeof SxLinear, sizeof SxBlock, and the offsets in SxBlock
    of eps, fused_qkv, q and down."""
    return [ctypes.sizeof(Linear), ctypes.sizeof(Block), Block.eps.offset, Block.fused_qkv.offset, Block.q.offset,
            Block.down.offset]


def check(lib: ctypes.CDLL) -> None:
    """Set every function's signature on `lib`; RuntimeError when its structs' layout is not the mirrors'."""
    for name, (res, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    want = layout()
    got = (_i64 * len(want))()
    n = lib.sx_layout(got, len(want))
    if n != len(want) or list(got) != want:
        raise RuntimeError(f"the library's struct layout {list(got)[:n]} is not cpu_kernels/abi.py's {want} "
                           "(sizes of SxLinear, SxBlock; offsets of eps, fused_qkv, q, down): edit both sides")
