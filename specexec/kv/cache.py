"""Preallocated static KV cache for one model, with per-layer storage: on the device, or streamed.

Slots [0, length) hold the committed prefix; slots from `length` on are scratch for new rows (tree node i
usually lives at slot length + i). `keep(slots)` commits accepted scratch rows by gathering them to
[length, length + n) — never a torch.cat; `advance(n)` commits rows written in order; `truncate(n)` forgets
from n on (a shared prompt prefix is kept); `grow(capacity)` reallocates, keeping the committed rows.

Where each layer's rows live (chosen by the memory plan, per layer):
- "device": one token-major store for all such layers on the model's device (specexec/kv/rows.py);
- "streamed": host RAM (pinned on CUDA), staged to the device with the layer's weights through the pager's
  slots; only committed rows move in, only committed rows move out (specexec/kv/stream.py).
Both hold the same rows bit for bit, so attention (hence greedy output) is identical either way.
- a state store: layers whose token mixer keeps something other than K/V rows per slot (a recurrent state:
  specexec/kv/recurrent.py) name a StateSpec (`states[i]`, from their mixer kind: specexec/network/mixers.py);
  the layers of one spec type share one store (specexec/kv/layer_store.py says what a store answers), which
  commits with the cache (keep, advance, truncate, grow) and which the layer reads through `state(layer)`.

`quant="int8"` stores rows as int8 with per-token, per-head scales (kv_rows.py): LOSSY, off by default, and
outside every exactness claim of this project.

Does not know: positions (RoPE is applied before write), trees, which slots are visible (the mask says), or
how the pager moves layers (it calls `companion`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from specexec.kv.layer_store import LayerStore, StateSpec
from specexec.kv.rows import Rows
from specexec.options import KV_QUANTS
from specexec.kv.stream import StreamedKV


def kv_slots_for(total: int, budget: int, draft_scratch: int | None) -> tuple[int, int]:
    """(target, draft) KV slots for `total` committed tokens (prompt + answer), each sized for its own user:
    the target holds one tree of `budget` nodes plus its root beyond them; the draft its builder's scratch
    (builder.kv_slots(budget), which starts at the root) plus one. Pending tokens the draft has not seen are
    part of the context, so they need no slot of their own. draft_scratch None: no draft cache (0). The
    engine sizes its caches with this and the memory ledger counts them with it."""
    return total + budget + 1, (0 if draft_scratch is None else total + draft_scratch + 1)


def pinned_layers(default: tuple[int, int], shapes: Sequence[tuple[int, int]], shared: Mapping[int, int]) -> set[int]:
    """The layers whose rows stay on the device even where the plan streams KV: rows of another shape than the
    `default` (KV heads, head size), and the rows other layers read (`shared` {layer: source})."""
    return {i for i, shape in enumerate(shapes) if tuple(shape) != tuple(default) and i not in shared} | \
        set(shared.values())


class KVCache:
    """Static per-model cache; capacity = context length + the largest tree budget (+1 for the root).

    streamed: layer ids whose rows live on the host and travel with their layer; tail: rows of one forward a
    streamed layer keeps on the device until they are committed (the tree budget + 1; longer forwards, i.e.
    prefill chunks, write straight through to the host); windows[i]: layer i's sliding window (None: full),
    so a streamed sliding layer moves only the rows its window sees; states[i]: layer i's StateSpec when its
    cache is not K/V rows (None or absent: rows); parts: 2 (K and V rows) or 1 (one row read as both);
    shapes[i]: layer i's (KV heads, head size) where it differs from (n_kv_heads, head_dim) (Gemma 4's full
    layers; such layers keep their rows on the device, never streamed); shared {layer: source}: layers with no
    rows of their own that read `source`'s (whose rows then stay on the device too)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, batch: int = 1, quant: str = "none",
                 streamed: Sequence[int] = (), tail: int = 0, windows: Sequence[int | None] = (),
                 states: Sequence[StateSpec | None] = (), parts: int = 2,
                 shapes: Sequence[tuple[int, int]] = (), shared: Mapping[int, int] | None = None) -> None:
        if quant not in KV_QUANTS:
            raise ValueError(f"unknown KV quantization {quant!r}; choose one of: {', '.join(KV_QUANTS)}")
        self.device, self.dtype, self.quant = torch.device(device), dtype, quant
        specs = {i: s for i, s in enumerate(states) if s is not None}
        shared = dict(shared or {})
        default = (n_kv_heads, head_dim)
        shape = [tuple(shapes[i]) if shapes else default for i in range(n_layers)]
        pinned = pinned_layers(default, shape, shared)
        streamed = sorted(set(streamed) - set(specs) - set(shared) - pinned)
        if streamed and not 0 <= streamed[0] <= streamed[-1] < n_layers:
            raise ValueError(f"streamed KV layers {streamed} are not all in [0, {n_layers})")
        own = [i for i in range(n_layers) if i not in set(streamed) and i not in specs and i not in shared]
        self.stores, self.states = self._state_stores(specs, capacity, batch, dtype)
        kinds = list(dict.fromkeys([default] + [shape[i] for i in own]))    # the default shape's group first
        groups = [[i for i in own if shape[i] == k] for k in kinds]
        self.group = {i: kinds.index(shape[i]) for i in own}
        self.where: list[tuple[str, int]] = [("device", groups[self.group[i]].index(i)) if i in self.group else
                                             ("streamed", streamed.index(i)) if i in streamed else
                                             ("state", self.states[i][1]) if i in specs else ("shared", -1)
                                             for i in range(n_layers)]
        for i, source in shared.items():
            self.where[i], self.group[i] = self.where[source], self.group.get(source, 0)
        self.row_groups = [Rows.empty(len(g), capacity, batch, *k, dtype, quant, self.device, parts=parts)
                           for k, g in zip(kinds, groups)]
        self.rows = self.row_groups[0]               # the rows of the (n_kv_heads, head_dim) layers
        self.shared = shared
        self.stream = StreamedKV(streamed, capacity, batch, n_kv_heads, head_dim, dtype, quant, self.device,
                                 tail, [windows[i] if windows else None for i in streamed], parts) if streamed else None
        self.capacity = capacity
        self.length = 0
        self.long_rope = False        # rows computed with LongRoPE's long factors (the engine sets it: rope.py)

    def _state_stores(self, specs: dict[int, StateSpec], capacity: int, batch: int, dtype: torch.dtype
                      ) -> tuple[list[LayerStore], dict[int, tuple[LayerStore, int]]]:
        """One store per spec type over its layers (in order), and per such layer (its store, its index there)."""
        stores: list[LayerStore] = []
        placed: dict[int, tuple[LayerStore, int]] = {}
        for kind in dict.fromkeys(type(spec) for spec in specs.values()):
            group = [i for i in sorted(specs) if type(specs[i]) is kind]
            store = kind.new_store([specs[i] for i in group], capacity, batch, dtype, self.device)
            stores.append(store)
            placed |= {layer: (store, j) for j, layer in enumerate(group)}
        return stores, placed

    # ------------------------------------------------------------------------------------- what it holds

    @property
    def streams(self) -> bool:
        """Whether any layer's rows are streamed."""
        return self.stream is not None

    @property
    def streamed_layers(self) -> list[int]:
        return [i for i, (where, _) in enumerate(self.where) if where == "streamed"]

    @property
    def nbytes(self) -> int:
        """Bytes of every stored row: device store, host rows, and the streamed layers' stages and tail."""
        return (sum(g.nbytes for g in self.row_groups) + (self.stream.nbytes if self.stream is not None else 0)
                + sum(store.nbytes for store in self.stores))

    def state(self, layer: int) -> tuple[LayerStore, int]:
        """(store, index of the layer in it) of a layer whose cache is a state store."""
        if layer not in self.states:
            raise ValueError(f"layer {layer} keeps K/V rows, not a state")
        return self.states[layer]

    @property
    def k(self) -> Tensor:
        """Head-major views [n_device_layers, B, H_kv, S, D] of the device store's K (V: `v`), as stored."""
        return self.rows.data[:, :, 0].permute(0, 2, 3, 1, 4)

    @property
    def v(self) -> Tensor:
        return self.rows.data[:, :, -1].permute(0, 2, 3, 1, 4)

    # ------------------------------------------------------------------------------------- per layer

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor | None) -> None:
        """Store k, v [B, H_kv, T, D] at slots [T] (each >= length) of one layer (v None for one-part rows: k
        is the row, read back as both key and value)."""
        if layer in self.shared:
            raise ValueError(f"layer {layer} reads layer {self.shared[layer]}'s rows; it writes none")
        where, j = self.where[layer]
        if where == "streamed":
            self.stream.write(layer, slots, k, v)
        else:
            rows = self.row_groups[self.group[layer]]
            rows.put(j, slots, rows.pack(k, v))

    def view(self, layer: int, n_slots: int) -> tuple[Tensor, Tensor]:
        """The first n_slots slots of one layer: k, v [B, H_kv, n_slots, D] in the run dtype (views of the
        stored rows, or their dequantized copy with int8)."""
        where, j = self.where[layer]
        if where == "streamed":
            return self.stream.view(layer, n_slots)
        return self.row_groups[self.group[layer]].read(j, n_slots)

    # ------------------------------------------------------------------------------------- commits

    def keep(self, slots: Tensor) -> None:
        """Commit the rows at `slots` [n] (ascending, all >= length) as the next n committed positions."""
        n = int(slots.numel())
        if n == 0:
            return
        self._check_room(n)
        dest = slice(self.length, self.length + n)
        for group in self.row_groups:
            if group.data.shape[0]:
                for t, rows in zip(group.parts(), group.take(slots).parts()):
                    t[:, dest] = rows                # take() copies: no overlap hazard
        if self.stream is not None:
            self.stream.keep(slots)
        for store in self.stores:
            store.keep(slots, self.length)
        self.length += n

    def advance(self, n: int) -> None:
        """Commit the n rows already written at [length, length + n) (a plain sequence: nothing moves on the
        device; a streamed layer writes them back)."""
        self._check_room(n)
        if self.stream is not None and n:
            self.stream.advance(n)
        for store in self.stores:
            store.advance(n, self.length)
        self.length += n

    def _check_room(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise RuntimeError(f"KV cache overflow: {self.length} + {n} > capacity {self.capacity}")

    def grow(self, capacity: int) -> None:
        """Reallocate to exactly `capacity` slots (never more: growth is the caller's choice, and the memory
        plan counts the capacity it reserved), keeping the committed prefix (used when a chat outgrows the
        planned context). The old store is dropped before the streamed part grows: at most one old store is
        held beside the new ones."""
        if capacity <= self.capacity:
            return
        for g, rows in enumerate(self.row_groups):
            self.row_groups[g] = rows.grown(capacity, self.length)
        self.rows = self.row_groups[0]
        if self.stream is not None:
            self.stream.grow(capacity)
        for store in self.stores:
            store.grow(capacity)
        self.capacity = capacity

    def truncate(self, length: int) -> None:
        """Forget everything from `length` on (used to reuse a shared prompt prefix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        for store in self.stores:
            store.truncate(length, self.length)
        self.length = length
        if self.stream is not None:
            self.stream.truncate(length)

    def reset(self) -> None:
        self.truncate(0)

    def reusable(self, length: int) -> int:
        """The longest committed prefix of at most `length` tokens `truncate` can return to: any with K/V rows
        only; a state store only to its snapshots (and the current length)."""
        length = min(length, self.length)
        for store in self.stores:
            length = store.reusable(length, self.length)
        return length

    def snapshot(self) -> None:
        """Let `truncate` return to the current length later (state stores keep a copy; rows need none)."""
        for store in self.stores:
            store.snapshot(self.length)

    # ------------------------------------------------------------------------------------- streaming

    def begin_forward(self) -> None:
        """A forward over this cache starts (the model calls it): what it needs of the streamed layers is
        what is committed now."""
        if self.stream is not None:
            self.stream.begin_forward()
        for store in self.stores:
            store.begin_forward(self.length)

    def attach(self, n_stages: int, discard: Callable[[], None] | None = None) -> None:
        """Stage the streamed layers through a pager with n_stages slots (`companion` is its callback;
        `discard` cancels its read-ahead, e.g. before the stages are reallocated)."""
        if self.stream is not None:
            self.stream.attach(n_stages, discard)

    def companion(self, layer: int, slot: int, stopped: Callable[[], bool]) -> int:
        """The pager's companion callback (offload.streaming.pager.Companion): stage a streamed layer's committed rows
        into the slot's stage as part of the slot's fill; bytes moved."""
        return self.stream.companion(layer, slot, stopped) if self.stream is not None else 0
