"""The streamed part of a KVCache: layers whose K/V rows live in host RAM (pinned on CUDA) and travel to the
device with their layer, through the pager's slots.

What moves, per streamed layer and target pass (and nothing else):
- in (H2D): the committed rows [0, L), into the device STAGE of the pager slot the layer's weights arrive in,
  on the pager's copy stream, as part of that slot's fill (`companion`, called by the pager's copier thread);
- computed on the device: the pass's new rows (a tree, a prefill chunk) are written into the stage, where
  attention reads them, and into the device TAIL [tail rows] that outlives the stage;
- out (D2H), after verification: only the ACCEPTED rows, gathered from the tail (`keep`), or all rows of a
  prefill chunk (`advance`). A forward writing more rows than the tail holds (a long prefill chunk) writes
  them straight through to the host rows instead (they are all committed).
Attention of a streamed layer reads its stage: the same rows, bit for bit, as a resident cache holds.

The copier stages a layer with the rows committed WHEN it copies: a read-ahead made right after a pass, before
its accepted rows are committed, lacks them. A stage records how many leading rows it holds; when the layer
is used and rows committed since are missing, they are topped up (on the compute stream): from the device
copy of the last commit's rows when that covers them (no host round trip), else from the host rows.
Truncation lowers what every stage counts as valid.

A sliding-window layer (window W) attends only to the committed rows [L - W + 1, L) (specexec/network/attention.py drops
the older ones from its plan), so only those are staged and topped up: its bytes in per pass are at most W - 1
rows, whatever the context. A stage records the rows [lo, valid) it holds; rows below lo are never read.

Ordering (CUDA): D2H copies run on the compute stream after the rows were computed; an event (`written`)
recorded after a commit's copies is waited for by the copy stream before it reads host rows again.

Without a pager (a resident model, tests) the cache stages each layer itself into one stage when it is used.

Does not know: trees, tokens or models; which layers stream (the plan says); the pager's internals (it is
handed `companion` and a `discard` callable that cancels any read-ahead).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from offload.streaming.tiers import host_buffer

from specexec.kv.rows import Packed, Rows


class StreamedKV:
    """Host rows of the streamed layers, their device tail and the device stages (see the module docstring)."""

    def __init__(self, layers: Sequence[int], capacity: int, batch: int, heads: int, dim: int, dtype: torch.dtype,
                 quant: str, device: torch.device, tail: int, windows: Sequence[int | None] = (),
                 parts: int = 2) -> None:
        """windows[j]: the sliding window of streamed layer layers[j] (None or absent: it sees every row); parts:
        2 for K/V rows, 1 for one row read as both (specexec/kv/rows.py)."""
        self.index = {layer: j for j, layer in enumerate(layers)}
        self.windows = {layer: (windows[j] if j < len(windows) else None) for j, layer in enumerate(layers)}
        self.device, self.cuda = device, device.type == "cuda"
        self.shape = (batch, heads, dim, dtype, quant, parts)
        self.host = Rows.empty(len(layers), capacity, batch, heads, dim, dtype, quant, "cpu", self._host_alloc, parts)
        self.tail = Rows.empty(len(layers), tail, batch, heads, dim, dtype, quant, device, parts=parts)
        self.stages: list[Rows] = []
        self.records: list[tuple[int, int, int]] = []   # per stage: (layer, lo, valid): rows [lo, valid) = the host's
        self.discard: Callable[[], None] | None = None
        self.length = 0                              # committed rows (the cache's length, kept in step)
        self.through = False                         # rows of the current forward went straight to the host
        self.recent: tuple[int, Packed] | None = None   # (first slot, device rows [n_layers, n, ...]) last committed
        self.written = None                          # CUDA event after the latest D2H writes
        self.lock = threading.Lock()
        self.moved_in = self.moved_out = 0           # bytes H2D (stages) / D2H (commits), for tests and stats
        self.topped_up = 0                           # bytes topped up into lagging stages (device copy or H2D)

    def _host_alloc(self, nbytes: int) -> Tensor:
        return host_buffer(nbytes, pin=self.cuda)

    @property
    def capacity(self) -> int:
        return self.host.capacity

    @property
    def nbytes(self) -> int:
        return self.host.nbytes + self.tail.nbytes + sum(s.nbytes for s in self.stages)

    def attach(self, n_stages: int, discard: Callable[[], None] | None) -> None:
        """Stage through a pager with n_stages slots (one stage each); `discard` cancels its read-ahead."""
        if self.discard is not None and self.discard is not discard:
            self.discard()
        self.discard = discard
        self._make_stages(n_stages)

    def _make_stages(self, n: int) -> None:
        B, H, D, dtype, quant, P = self.shape
        self.stages = [Rows.empty(1, self.capacity, B, H, D, dtype, quant, self.device, parts=P) for _ in range(n)]
        self.records = [(-1, 0, 0)] * n

    # ------------------------------------------------------------------------------------- copier side

    def companion(self, layer: int, slot: int, stopped: Callable[[], bool]) -> int:
        """The pager's companion: stage `layer`'s committed rows into stage `slot` (on the current stream: the
        copy stream, inside the pager's fill of that slot); returns the bytes moved (0 when the layer's KV is
        not streamed)."""
        j = self.index.get(layer)
        if j is None or slot >= len(self.stages):
            return 0
        with self.lock:
            n, written = self.length, self.written
            lo = self.first_needed(layer, n)
            self.records = [(-1, 0, 0) if r[0] == layer else r for r in self.records]
            self.records[slot] = (layer, lo, n)
        with torch.inference_mode():                  # the stages may be inference tensors (made while generating)
            return self._copy_in(j, self.stages[slot], lo, n, written)

    def first_needed(self, layer: int, length: int) -> int:
        """The first committed row a forward over `length` committed rows reads in `layer` (its window's)."""
        window = self.windows.get(layer)
        return max(0, length - window + 1) if window else 0

    def _copy_in(self, j: int, stage: Rows, start: int, stop: int, written) -> int:
        """Host rows [start, stop) of streamed layer j into the same rows of `stage` (after `written`, the
        event of the D2H copies that wrote them, on CUDA); bytes moved."""
        if stop <= start:
            return 0
        if written is not None:
            torch.cuda.current_stream(self.device).wait_event(written)
        src = self.host.layer_rows(j, start, stop)
        stage.put_at(0, start, src, non_blocking=self.cuda)
        moved = sum(t.numel() * t.element_size() for t in src.parts())
        with self.lock:                               # the copier thread and the compute side both count
            self.moved_in += moved
        return moved

    # ------------------------------------------------------------------------------------- compute side

    def stage_of(self, layer: int) -> Rows:
        """The stage holding `layer`'s committed rows (topped up to the committed length when it lags)."""
        need = self.first_needed(layer, self.length)
        with self.lock:                               # the copier rewrites records as it fills slots
            s = next((i for i, r in enumerate(self.records) if r[0] == layer), None)
            if s is None and self.discard is None:    # no pager: stage it here, in stage 0
                if not self.stages:
                    self._make_stages(1)
                s, self.records[0] = 0, (layer, need, need)
            _, lo, valid = self.records[s] if s is not None else (layer, 0, 0)
        if s is None:
            raise RuntimeError(f"KV rows of layer {layer} were not staged with the layer (pager out of step)")
        if lo > need or valid < need:                 # truncated below it, or the window passed it: from `need`
            lo = valid = need
        if valid < self.length:
            self._top_up(self.index[layer], self.stages[s], valid)
        with self.lock:
            self.records[s] = (layer, lo, self.length)
        return self.stages[s]

    def _top_up(self, j: int, stage: Rows, valid: int) -> None:
        """Rows [valid, length) committed after the stage was filled: from the last commit's device rows when
        they cover them, else from the host."""
        first, rows = self.recent if self.recent is not None else (self.length, None)
        if rows is not None and first <= valid and first + rows.data.shape[1] >= self.length:
            src = Packed.of([t[j, valid - first:self.length - first] for t in rows.parts()])
            stage.put_at(0, valid, src)
            self.topped_up += sum(t.numel() * t.element_size() for t in src.parts())
            return
        self.topped_up += self._copy_in(j, stage, valid, self.length, self.written)

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor | None) -> None:
        """Rows k, v [B, H, T, D] at `slots` [T] (each >= length): into the layer's stage, and into the tail
        (rows slots - length) or, when T exceeds the tail, straight to the host (slots must then be
        [length, length + T))."""
        stage, j = self.stage_of(layer), self.index[layer]
        rows = stage.pack(k, v)
        stage.put(0, slots, rows)
        T = slots.numel()
        if T <= self.tail.capacity:
            self.tail.put(j, slots - self.length, rows)
            return
        if slots.device.type == "cpu" and not torch.equal(slots, torch.arange(self.length, self.length + T)):
            raise ValueError("a streamed KV layer writes more rows than its tail only at [length, length + T)")
        self.host.put_at(j, self.length, rows, non_blocking=self.cuda)
        self.moved_out += sum(t.numel() * t.element_size() for t in rows.parts())
        self.through = True

    def view(self, layer: int, n: int) -> tuple[Tensor, Tensor]:
        return self.stage_of(layer).read(0, n)

    # ------------------------------------------------------------------------------------- commits

    def keep(self, slots: Tensor) -> None:
        """Commit the rows at `slots` [n] (written by the last forward) as [length, length + n): the accepted
        rows are gathered from the tail and written back (D2H), or gathered on the host when they went
        straight there."""
        L, n = self.length, slots.numel()
        if self.through:
            self._sync()
            idx = slots.cpu()
            for t in self.host.parts():
                t[:, L:L + n] = t.index_select(1, idx)
            self._committed(L + n, None)
            return
        rows = self.tail.take(slots - L)
        for j in range(len(self.index)):
            self._write_back(j, L, [t[j] for t in rows.parts()])
        self._committed(L + n, (L, rows))

    def advance(self, n: int) -> None:
        """Commit the n rows written at [length, length + n) by the last forward."""
        L = self.length
        if self.through:
            self._committed(L + n, None)
            return
        rows = Packed.of([t[:, :n].clone() for t in self.tail.parts()])
        for j in range(len(self.index)):
            self._write_back(j, L, [t[j] for t in rows.parts()])
        self._committed(L + n, (L, rows))

    def _write_back(self, j: int, start: int, parts: list[Tensor]) -> None:
        for dst, src in zip(self.host.parts(), parts):
            dst[j, start:start + src.shape[0]].copy_(src, non_blocking=self.cuda)
            self.moved_out += src.numel() * src.element_size()

    def _committed(self, length: int, recent: tuple[int, Packed] | None) -> None:
        written = None
        if self.cuda:
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self.device))
        with self.lock:
            self.length, self.through, self.recent = length, False, recent
            self.written = written if written is not None else self.written

    def truncate(self, length: int) -> None:
        with self.lock:
            self.length, self.through = length, False
            self.records = [(layer, min(lo, length), min(valid, length)) for layer, lo, valid in self.records]
            if self.recent is not None and self.recent[0] >= length:
                self.recent = None

    def begin_forward(self) -> None:
        """A forward starts: what it writes decides where its rows are (tail or host)."""
        self.through = False

    def grow(self, capacity: int) -> None:
        """Reallocate host rows and stages for `capacity` slots, keeping the committed rows. The old rows are
        dropped only once no copy uses them (the read-ahead discarded and fenced, the D2H writes waited for),
        and dropping them unpins them (offload/streaming/tiers.py)."""
        if self.discard is not None:
            self.discard()                            # no read-ahead may copy into the old stages
        self._sync()
        self.host = self.host.grown(capacity, self.length, self._host_alloc)
        self._make_stages(len(self.stages))

    def _sync(self) -> None:
        """The host rows are final (the D2H copies into them are done); only these copies are waited for."""
        if self.cuda and self.written is not None:
            self.written.synchronize()
        if self.cuda and self.through:
            torch.cuda.current_stream(self.device).synchronize()
