"""Batch-invariant CPU attention: each query row attends over its own list of cache slots, in the listed order,
with arithmetic that depends only on that row's query and the keys and values it sees. So a token's output in
a tree pass (the committed prefix, then its ancestors and itself) has the same bits as in the one-token decode
that sees the same slots' keys in the same order: with the row-exact int4/int8 linears (ops.py), a quantized
target's tree pass gives bitwise its one-token logits, and speculative greedy output equals the target alone.

    slots idx int32 [B|1, T, L], lens int32 [B|1, T]: row t of batch b sees slots idx[b, t, :lens[b, t]]
    attend_rows(q [B, H, T, D], k, v [B, H_kv, S, D], idx, lens, scale) -> [B, H, T, D] in q's dtype

Two implementations: the compiled kernel (csrc/attend.c sx_attend_rows: per row the scores and their max, then exp and
its sum, then the weighted values, sequential over the slots, threaded over (row, KV head) with that KV head's query
heads together: each key read once for them) and a pure-torch twin (`attend_rows_torch`, where the kernels cannot be
had), which is batch-invariant the same way (each row gathers its own keys and runs the same shapes as the one-token
decode does) but rounds differently from the kernel (its exp, its matmul order): the two agree to fp32 rounding,
each is exact against itself.

Does not know: trees, masks' construction (specexec/network/attention.py makes the slot lists), the cache.
"""
from __future__ import annotations

import torch

from cpu_kernels.build import library


def slot_lists(seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [B|1, T, S] (row t sees slot j) -> (idx int32 [B|1, T, L], lens int32 [B|1, T]): each row's slots in
    increasing order, L the longest row (the tail of a shorter row is unused)."""
    S = seen.shape[-1]
    lens = seen.sum(-1, dtype=torch.int32)
    order = torch.where(seen, torch.arange(S, dtype=torch.int32, device=seen.device), S)
    L = int(lens.max()) if lens.numel() else 0
    idx = order.sort(-1).values[..., :L].clamp_(max=max(S - 1, 0)).to(torch.int32).contiguous()
    return idx, lens.contiguous()


def attend_rows_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, lens: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """The pure-torch twin of the kernel: per (batch, row) the row's keys gathered, fp32 softmax, fp32 values."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    out = torch.empty(B, H, T, D, dtype=q.dtype)
    for b in range(B):
        bi = 0 if idx.shape[0] == 1 else b
        for t in range(T):
            sl = idx[bi, t, : int(lens[bi, t])].long()
            kk, vv = k[b].index_select(1, sl).float(), v[b].index_select(1, sl).float()   # [H_kv, n, D]
            qq = q[b, :, t].float().reshape(Hkv, H // Hkv, D)
            probs = torch.softmax(torch.matmul(qq, kk.transpose(1, 2)) * scale, dim=-1)
            out[b, :, t] = torch.matmul(probs, vv).reshape(H, D).to(q.dtype)
    return out


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, lens: torch.Tensor,
                scale: float) -> torch.Tensor:
    """q [B, H, T, D]; k, v [B, H_kv, S, D] (any strides, last dimension contiguous; cast to q's dtype);
    idx, lens: slot_lists' -> out [B, H, T, D] in q's dtype (fp32 or bf16; others run in fp32)."""
    lib = library()
    dtype = q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32
    q, k, v = (t.to(dtype) if t.stride(-1) == 1 else t.to(dtype).contiguous() for t in (q, k, v))
    if lib is None:
        return attend_rows_torch(q, k, v, idx, lens, scale)
    B, H, T, D = q.shape
    out = torch.empty(B, H, T, D, dtype=dtype)
    strides = [torch.tensor(t.stride()[:3], dtype=torch.int64) for t in (q, k, v)]
    rc = lib.sx_attend_rows(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), int(dtype == torch.bfloat16),
                            B, H, k.shape[1], T, D, *(s.data_ptr() for s in strides), idx.data_ptr(),
                            lens.data_ptr(), idx.shape[0], idx.shape[-1], scale, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"sx_attend_rows failed ({rc}) on q {list(q.shape)}, k {list(k.shape)}")
    return out
