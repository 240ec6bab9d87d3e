"""K/V rows of a group of decoder layers in one tensor, token-major, optionally int8 (the storage of KVCache).

Layout: data [n_layers, S, P, B, H_kv, D]: for each layer, one row per cache slot holding that slot's K
(index 0 of dim 2) and V (index 1) for every batch entry and KV head; P = 2, or P = 1 where one stored row
serves as both key and value (latent attention's row: specexec/kv/latent.py). A range of slots of one layer is ONE
contiguous block, so moving the committed rows of a layer between host and device is one copy, and
committing rows is one gather over dim 1 for all layers at once. Attention gets head-major views
[B, H_kv, n, D] of it (a permute, no copy: the fused SDPA kernels take the strides).

Quantization ("int8", lossy, opt-in): symmetric per token, per KV head, per K/V: q = round(x / s) with
s = max|x| / 127 over the head dimension, kept as scale [n_layers, S, P, B, H_kv, 1] in fp32; `read`
dequantizes (q * s) into the run dtype. Rows are quantized once, when written.

Does not know: which layers it holds (the cache maps them), devices beyond the tensors' own, attention.
"""
from __future__ import annotations

import torch
from torch import Tensor

from specexec.options import KV_QUANTS

INT8_MAX = 127


def row_bytes(n_kv_heads: int, head_dim: int, elem: int, quant: str = "none", batch: int = 1,
              parts: int = 2) -> int:
    """Bytes of one slot of one layer (K and V of every head; `parts` 1: one row serving as both): the ledger's
    unit of KV memory."""
    per_head = head_dim + 4 if quant == "int8" else head_dim * elem
    return parts * batch * n_kv_heads * per_head


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (q int8 [..., D], scale fp32 [..., 1]) with x ~ q * scale, symmetric per row."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-30) / INT8_MAX
    return (xf / scale).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return (q.float() * scale).to(dtype)


class Packed:
    """Rows ready to store: data [..., T, P, B, H, D] (run dtype or int8) and scale [..., T, P, B, H, 1] or None."""

    __slots__ = ("data", "scale")

    def __init__(self, data: Tensor, scale: Tensor | None) -> None:
        self.data, self.scale = data, scale

    @classmethod
    def of(cls, parts: list[Tensor]) -> "Packed":
        """From parts() of some rows: [data] or [data, scale]."""
        return cls(parts[0], parts[1] if len(parts) > 1 else None)

    def parts(self) -> list[Tensor]:
        return [self.data] if self.scale is None else [self.data, self.scale]


class Rows:
    """K/V rows of n layers (see the module docstring). `quant` "none" stores the run dtype; `parts` (P) is 2
    (K and V) or 1 (one row read as both)."""

    def __init__(self, data: Tensor, scale: Tensor | None, dtype: torch.dtype) -> None:
        self.data, self.scale, self.dtype = data, scale, dtype

    @classmethod
    def empty(cls, n_layers: int, capacity: int, batch: int, heads: int, dim: int, dtype: torch.dtype,
              quant: str, device: torch.device | str, host_alloc=None, parts: int = 2) -> "Rows":
        """Zeroed rows on `device`; host_alloc(nbytes) -> uint8 CPU tensor replaces the allocation (pinned host
        memory: rows there are never read before they are written, so they are not zeroed)."""
        if quant not in KV_QUANTS:
            raise ValueError(f"unknown KV quantization {quant!r}; choose one of: {', '.join(KV_QUANTS)}")
        if parts not in (1, 2):
            raise ValueError(f"a row holds K and V (2 parts) or one shared row (1), not {parts}")
        shape = (n_layers, capacity, parts, batch, heads, dim)
        store = torch.int8 if quant == "int8" else dtype
        data = _alloc(shape, store, device, host_alloc)
        scale = _alloc(shape[:-1] + (1,), torch.float32, device, host_alloc) if quant == "int8" else None
        return cls(data, scale, dtype)

    @property
    def quant(self) -> str:
        return "none" if self.scale is None else "int8"

    @property
    def capacity(self) -> int:
        return self.data.shape[1]

    @property
    def row_parts(self) -> int:
        """Parts per row: 2 (K and V) or 1 (one row read as both)."""
        return self.data.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts())

    def parts(self) -> list[Tensor]:
        return [self.data] if self.scale is None else [self.data, self.scale]

    def pack(self, k: Tensor, v: Tensor | None) -> Packed:
        """k, v [B, H, T, D] -> rows [T, P, B, H, D] in this store's format (quantized when int8); v is None for
        one-part rows (k is the row)."""
        kv = (torch.stack((k, v)) if self.row_parts == 2 else k[None]).permute(3, 0, 1, 2, 4)
        if self.scale is None:
            return Packed(kv.to(self.data.dtype).contiguous(), None)     # contiguous: one copy to the host
        q, s = quantize_int8(kv)
        return Packed(q.contiguous(), s.contiguous())

    def put(self, layer: int, index: Tensor, rows: Packed) -> None:
        """Store rows [T, ...] at slots `index` [T] of one layer."""
        for dst, src in zip(self.parts(), rows.parts()):
            dst[layer].index_copy_(0, index, src)

    def put_at(self, layer: int, start: int, rows: Packed, non_blocking: bool = False) -> None:
        """Store rows [T, ...] at the slots [start, start + T) of one layer (one copy per part)."""
        for dst, src in zip(self.parts(), rows.parts()):
            dst[layer, start:start + src.shape[0]].copy_(src, non_blocking=non_blocking)

    def take(self, index: Tensor) -> Packed:
        """The rows at slots `index` [n] of every layer: [n_layers, n, ...] (a gather: a copy)."""
        return Packed.of([t.index_select(1, index) for t in self.parts()])

    def layer_rows(self, layer: int, start: int, stop: int) -> Packed:
        """Views of one layer's rows [start, stop)."""
        return Packed.of([t[layer, start:stop] for t in self.parts()])

    def read(self, layer: int, n: int) -> tuple[Tensor, Tensor]:
        """k, v [B, H, n, D] of the first n slots of one layer in the run dtype (views unless int8; one-part
        rows: the same tensor twice)."""
        rows = self.data[layer, :n].permute(1, 2, 3, 0, 4)                 # [P, B, H, n, D]
        if self.scale is not None:
            rows = dequantize(rows, self.scale[layer, :n].permute(1, 2, 3, 0, 4), self.dtype)
        return rows[0], rows[-1]

    def grown(self, capacity: int, keep: int, host_alloc=None) -> "Rows":
        """New rows with `capacity` slots holding this one's first `keep` slots (the caller drops this one)."""
        n, _, P, B, H, D = self.data.shape
        new = Rows.empty(n, capacity, B, H, D, self.dtype, self.quant, self.data.device, host_alloc, P)
        for dst, src in zip(new.parts(), self.parts()):
            dst[:, :keep] = src[:, :keep]
        return new


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, host_alloc) -> Tensor:
    if host_alloc is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    n = 1
    for s in shape:
        n *= s
    return host_alloc(n * dtype.itemsize).view(dtype).view(shape)
