"""What a cache store of layers whose token mixer keeps something other than K/V rows answers (LayerStore), and
what names such a layer's cache (StateSpec). specexec/kv/cache.py's KVCache holds one store per spec type and
calls it at every commit; the mixer reads and writes its layer's part through `KVCache.state(layer)`.

The two questions every kind of cache answers for a tree pass:
1. each node's output sees only its ancestors: the mixer computes it from the committed state and what the
   pass's mask row shows (its ancestors' scratch data), never a sibling's;
2. `keep(slots)` commits an accepted path, in order, from the store's own data: no weights (a streamed layer's
   weights are gone after its pass).

Does not know: which kind of mixer uses it, models, trees beyond "slots of a pass".
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class LayerStore(Protocol):
    """The cache of a group of layers of one kind. `length` arguments are the cache's committed length at the
    call (before it changes)."""

    spec_type: type

    @property
    def nbytes(self) -> int: ...

    def begin_forward(self, length: int) -> None:
        """A forward over the cache starts with `length` committed slots."""

    def keep(self, slots: Tensor, length: int) -> None:
        """Commit the accepted path at `slots` [n] (ascending, >= length; each the previous one's child)."""

    def advance(self, n: int, length: int) -> None:
        """Commit the n slots [length, length + n) written in order (a prefill chunk)."""

    def truncate(self, length: int, current: int) -> None:
        """Return to `length` committed slots (one `reusable` allowed; ValueError otherwise)."""

    def reusable(self, length: int, current: int) -> int:
        """The longest prefix of at most `length` slots `truncate` can return to."""

    def snapshot(self, length: int) -> None:
        """Remember the state at the current `length` for a later truncate."""

    def grow(self, capacity: int) -> None:
        """The cache now has `capacity` slots."""


class StateSpec(Protocol):
    """The shape of one layer's state; the class makes the store of its layers (one per cache)."""

    @classmethod
    def new_store(cls, specs: list, capacity: int, batch: int, dtype: torch.dtype,
                  device: torch.device) -> LayerStore: ...
