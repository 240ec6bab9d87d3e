"""Preallocated static KV cache for one model.

Layout per layer: k, v of shape [B, H_kv, S_cap, D]. Slots [0, length) hold the committed prefix; slots from
`length` on are scratch for tree nodes (node i of a tree usually lives at slot length + i). `keep(slots)`
commits accepted scratch rows by copying them to [length, length + n) — a gather, never a torch.cat.

Does not know: positions (RoPE is applied before write), trees, or which slots are visible (the mask says).
"""
from __future__ import annotations

import torch


class KVCache:
    """Static per-model cache; capacity = context length + the largest tree budget (+1 for the root)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, batch: int = 1) -> None:
        shape = (n_layers, batch, n_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, H_kv, T, D] at slots [T] of one layer."""
        self.k[layer].index_copy_(2, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(2, slots, v.to(self.v.dtype))

    def view(self, layer: int, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n_slots slots of one layer: k, v [B, H_kv, n_slots, D] (views, no copy)."""
        return self.k[layer, :, :, :n_slots], self.v[layer, :, :, :n_slots]

    def keep(self, slots: torch.Tensor) -> None:
        """Commit the rows at `slots` [n] (ascending, all >= length) as the next n committed positions."""
        n = int(slots.numel())
        if n == 0:
            return
        if self.length + n > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.length} + {n} > capacity {self.capacity}")
        dest = slice(self.length, self.length + n)
        self.k[:, :, :, dest] = self.k.index_select(3, slots)   # index_select copies: no overlap hazard
        self.v[:, :, :, dest] = self.v.index_select(3, slots)
        self.length += n

    def advance(self, n: int) -> None:
        """Commit the n rows already written at [length, length + n) (a plain sequence: nothing moves)."""
        if self.length + n > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.length} + {n} > capacity {self.capacity}")
        self.length += n

    def grow(self, capacity: int) -> None:
        """Reallocate to exactly `capacity` slots (never more: growth is the caller's choice, and the memory
        plan counts the capacity it reserved), keeping the committed prefix (used when a chat outgrows the
        planned context). K is copied and freed before V is reallocated: at most one old tensor is held beside
        the new ones."""
        if capacity <= self.capacity:
            return
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[:3] + (capacity,) + old.shape[4:])
            new[:, :, :, : self.length] = old[:, :, :, : self.length]
            setattr(self, name, new)
            del old, new
        self.capacity = capacity

    def truncate(self, length: int) -> None:
        """Forget everything from `length` on (used to reuse a shared prompt prefix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0
