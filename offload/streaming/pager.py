"""LayerPager: hands out packed layers in order, streaming the non-resident ones through N slots.

`layers(ids)` yields (i, view) for each layer id; a view of a streamed layer lives in a slot and is valid
until the next iteration (then the slot is refilled). Loader threads fill slots ahead of the consumer:
- the copier, in layer order: slot k % n_slots gets the k-th streamed layer of the pass, from the RAM tier (on
  CUDA an async H2D copy on the pager's ONE copy stream), from a bounce buffer (staged SSD reads, below) or, on
  the CPU, straight from the disk (the SSD read fills the host slot);
- the reader (staged SSD, i.e. CUDA): reads SSD layers from disk into a ring of n_bounce pinned host buffers,
  as far ahead as the ring allows, independently of the slots; the copier moves them to the device.
The threads live in loaders.py. So the read-ahead depth is n_slots layers (n_slots + n_bounce when staged);
`prefetch_start()` (called after a pass, while the draft grows its tree) starts the next pass and the threads keep
loading until every buffer is full. The planner decides n_slots and n_bounce; the pager works with any depth >= 1.

On CUDA nothing here blocks the host or the device beyond need: the copy stream waits (event) until the
compute that last read a slot is done, compute waits (event) until the slot's copy is done, the reader waits
(event, in its own thread) until the copy out of a bounce buffer is done. No device-wide synchronize anywhere.

Companions: a caller may hang per-layer byte buffers on the layers it streams (`companion`, e.g. a layer's
KV cache rows kept in host RAM). The copier calls companion(i, slot, stopped) right after it queued layer i's
bytes into `slot` (inside the copy stream on CUDA), so whatever it copies travels with the layer: it is part
of the slot's fill, compute waits for it like for the weights, and its bytes count in `companion_bytes`. It
may wait (for its source to be final) but returns when stopped() says the fill was cancelled. `discard()`
cancels a read-ahead (e.g. one made for another companion).

Timing is on the device's clock (timing.py): per layer, copy start/end events on the copy stream and
compute start/end events on the compute stream; a pass is folded into `stats` once all its events completed
(`collect()` never waits unless asked). On CPU the same records hold host timestamps.

Parts (parts.py): with `heads`, the read-ahead moves only each layer's first heads[i] bytes (e.g. an MoE
layer's dense part); the consumer fills more of the layer it holds with `fill_ranges(i, slot, ranges)` when it
knows which ranges it needs (the experts its rows were routed to), and those bytes count too.

Does not know: what the bytes mean (the caller's `bind` turns a buffer into views or a module; a companion
moves its own buffers), which layer goes in which tier (planner.py), models or tokens.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from offload.streaming.timing import HostEvent, LayerTiming, PagerStats, PassTiming, fold
from offload.streaming.loaders import WAIT_TICK, Buffer, Job, Loaders
from offload.streaming.parts import RangeFiller, check_heads
from offload.streaming.tiers import LayerReader, RamTier, ResidentTier, fill, host_buffer

Bind = Callable[[int, int, torch.Tensor], Any]      # (layer, slot or -1 when resident, uint8 buffer) -> view
Companion = Callable[[int, int, Callable[[], bool]], int]   # (layer, slot, stopped) -> bytes it moved


class LayerPager(Loaders):
    """Layers by id from a ResidentTier (used in place), a RamTier and/or an SSD LayerReader (streamed).

    n_slots: slots streamed layers pass through (>= 1 when anything streams); n_bounce: host bounce buffers
    the SSD reader reads ahead into when staged (default: on CUDA with an SSD tier; `staged=True` runs the same
    two-thread path on the CPU, for tests)."""

    def __init__(self, sizes: Sequence[int], device: torch.device | str, resident: ResidentTier | None = None,
                 ram: RamTier | None = None, ssd: LayerReader | None = None, ssd_ids: Sequence[int] = (),
                 n_slots: int = 2, n_bounce: int = 2, bind: Bind | None = None, staged: bool | None = None,
                 heads: Sequence[int] | None = None) -> None:
        self.device = torch.device(device)
        self.sizes = list(sizes)
        self.heads = check_heads(heads, self.sizes) if heads is not None else list(self.sizes)
        self.resident, self.ram, self.ssd = resident, ram, ssd
        self.tiers = [self._tier(i, set(ssd_ids)) for i in range(len(self.sizes))]
        self.bind: Bind = bind or (lambda i, slot, buf: buf)
        self.companion: Companion | None = None        # bytes that travel with each streamed layer (see above)
        self.stats = PagerStats()
        cuda = self.device.type == "cuda"
        streamed = [self.sizes[i] for i, t in enumerate(self.tiers) if t != "resident"]
        if streamed and n_slots < 1:
            raise ValueError("streamed layers need at least one slot")
        self.slot_bytes = max(streamed, default=0)
        self.slots = [Buffer(self._slot_memory()) for _ in range(n_slots if streamed else 0)]
        self.staged = "ssd" in self.tiers and (cuda or bool(staged))
        self.bounce = [Buffer(host_buffer(self.slot_bytes, pin=cuda)) for _ in range(max(n_bounce, 1))
                       ] if self.staged else []
        self.copy_stream = torch.cuda.Stream(self.device) if cuda and streamed else None
        self._cv = threading.Condition()
        self._queues: dict[str, deque[Job | None]] = {"copy": deque(), "read": deque()}
        self._waiting: dict[str, Callable[[], bool]] = {}      # stage -> what it waits for
        self._threads: dict[str, threading.Thread] = {}
        self._crashed: tuple[str, BaseException] | None = None  # a loader thread that died (stage, error)
        self._pending: deque[PassTiming] = deque()             # passes not folded into stats yet
        self.last_pass: PassTiming | None = None                # the latest pass's events (benchmarks, tests)
        self._stats_lock = threading.Lock()
        self._job: Job | None = None
        self._last_ids: list[int] = list(range(len(self.sizes)))
        self.last_copy: Any = None                              # copy-end event of the latest fill (CUDA)
        self.parts = RangeFiller(self)                          # the consumer's fills of more of a layer

    def _tier(self, i: int, ssd_ids: set[int]) -> str:
        if self.resident is not None and i in self.resident.buffers:
            return "resident"
        if self.ram is not None and i in self.ram.buffers:
            return "ram"
        if i in ssd_ids and self.ssd is not None:
            return "ssd"
        raise ValueError(f"layer {i} is in no tier (resident, ram, or an ssd source with it in ssd_ids)")

    def _slot_memory(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
        return host_buffer(self.slot_bytes)

    def tier_of(self, i: int) -> str:
        return self.tiers[i]

    @property
    def depth(self) -> int:
        """Streamed layers loaded ahead of the consumer at most: the slots, plus the bounce ring when staged."""
        return len(self.slots) + len(self.bounce)

    def _event(self, stream: Any = None) -> Any:
        """An event recorded now: on `stream` (default: the current compute stream) on CUDA, else host time."""
        if self.device.type != "cuda":
            return HostEvent().record()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    # ------------------------------------------------------------------------------------- consumer side

    def layers(self, ids: Sequence[int] | None = None) -> Iterator[tuple[int, Any]]:
        """(i, bind(i, slot, buffer)) for each id in order; a streamed layer's buffer is valid until the next
        iteration. Leaving the loop early cancels the read-ahead."""
        ids = list(range(len(self.sizes))) if ids is None else list(ids)
        job = self._take([i for i in ids if self.tiers[i] != "resident"])
        self.collect()                                   # fold what the device already finished (never waits)
        timing = PassTiming(self._event())
        k, finished = 0, False
        try:
            for i in ids:
                if self.tiers[i] == "resident":
                    timing.layers.append(lt := LayerTiming("resident"))
                    yield from self._serve(i, -1, self.resident.buffer(i)[:self.sizes[i]], lt)
                    continue
                slot_index = k % len(self.slots)
                slot = self.slots[slot_index]
                timing.layers.append(lt := self._acquire(slot, job, i))
                self.stats.bytes[self.tiers[i]] += self.heads[i]
                self.stats.companion_bytes += lt.companion_bytes
                try:
                    yield from self._serve(i, slot_index, slot.buf[:self.sizes[i]], lt)
                finally:
                    self._release(slot, lt)
                k += 1
            finished = True
        finally:
            if not finished:
                self._cancel(job)
            self._last_ids = ids
            self.stats.passes += 1
            with self._stats_lock:
                self._pending.append(timing)
            self.last_pass = timing
            self.collect()

    def _serve(self, i: int, slot: int, buf: torch.Tensor, lt: LayerTiming) -> Iterator[tuple[int, Any]]:
        """Yield one layer between compute start/end events (the consumer's work on it is the compute)."""
        lt.compute_start = self._event()
        try:
            yield i, self.bind(i, slot, buf)
        finally:
            lt.compute_end = self._event()
            self.stats.layers += 1

    def _acquire(self, slot: Buffer, job: Job, i: int) -> LayerTiming:
        """Wait (host) until the copier filled `slot` with layer i; on CUDA make compute wait for the copy."""
        with self._cv:
            while not slot.holds(job, i):
                if self._crashed is not None:
                    stage, error = self._crashed
                    raise RuntimeError(f"the layer pager's {stage} thread stopped: {error!r}") from error
                if job.error is not None:
                    raise RuntimeError(f"loading layer {job.error_layer} failed: {job.error}") from job.error
                if slot.full or job.done:
                    raise RuntimeError(f"pager slot holds layer {slot.layer}, expected {i} (loader out of step)")
                self._cv.wait(WAIT_TICK)
            lt = slot.timing
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(lt.copy_end)
        return lt

    def fill_ranges(self, i: int, slot: int, ranges: Sequence[tuple[int, int]]) -> int:
        """(consumer, while it holds layer i in slot `slot`) Copy more of layer i into the slot: byte ranges
        (offset, nbytes) from its tier to the same offsets, now (parts.py). Returns the bytes moved (0 for a
        resident layer), which count in the tier's streamed bytes."""
        moved = self.parts.fill(i, slot, ranges)
        if moved:
            self.stats.bytes[self.tiers[i]] += moved
        return moved

    def _release(self, slot: Buffer, lt: LayerTiming) -> None:
        with self._cv:
            slot.used = lt.compute_end
            slot.empty()
            self._cv.notify_all()

    # ------------------------------------------------------------------------------------- jobs

    def prefetch_start(self, ids: Sequence[int] | None = None) -> None:
        """Start loading the streamed layers of the next pass (default: the same ids as the last pass) now,
        e.g. while the draft grows its tree: the loader threads fill every slot (and bounce buffer) and then
        wait for the pass. A no-op when nothing streams or a job is already queued for those layers."""
        ids = self._last_ids if ids is None else list(ids)
        streamed = [i for i in ids if self.tiers[i] != "resident"]
        job = self._job
        if not streamed or (job is not None and not job.taken and not job.cancelled and job.ids == streamed):
            return
        self._submit(streamed)

    def _take(self, streamed: list[int]) -> Job:
        """The queued job if it loads exactly `streamed`, nothing consumed it yet and it was not cancelled (a
        read-ahead that failed is taken: the pass raises its error); else a new one."""
        job = self._job
        if job is None or job.taken or job.cancelled or job.ids != streamed or self._orphan(job):
            job = self._submit(streamed)
        job.taken = True
        return job

    def _submit(self, streamed: list[int]) -> Job:
        if self._job is not None and not self._job.done:
            self._cancel(self._job)
        job = Job(streamed, [i for i in streamed if self.staged and self.tiers[i] == "ssd"])
        self._job = job
        if not streamed:
            job.done = True
            return job
        self._start_threads()
        with self._cv:
            self._queues["copy"].append(job)
            self._cv.notify_all()
        return job

    def _cancel(self, job: Job) -> None:
        """Stop `job`, wait for the loader threads to let go of it, and mark every buffer empty."""
        with self._cv:
            job.cancelled = True
            if job in self._queues["copy"]:
                self._queues["copy"].remove(job)
                job.done = True
            self._cv.notify_all()
            while not job.done:
                if not job.started or (self._crashed is not None and self._survivors_let_go()):
                    job.done = True                 # never queued (Ctrl-C between `_job = job` and the queue),
                    break                           # or a dead loader thread can never finish its share
                self._cv.wait(WAIT_TICK)
            for b in self.slots + self.bounce:
                b.empty()
            self._cv.notify_all()

    def _survivors_let_go(self) -> bool:
        """(cv held, a loader thread died) Every other loader thread waits, for a job or a buffer: none is
        inside a job's copy or read, so the cancelled job is no one's any more."""
        dead = self._crashed[0]
        return all(stage in self._waiting for stage in self._threads if stage != dead)

    def discard(self) -> None:
        """Cancel the read-ahead (queued or running job): every buffer is empty afterwards and no copy the
        loaders queued is still running (`_fence`: the caller may free or reuse what they read, e.g. a
        companion's host rows or stages); the next pass loads afresh. A no-op when nothing is loading."""
        if self._job is not None:
            self._cancel(self._job)
        self._fence()

    def _fence(self) -> None:
        """(host) Wait for the copies already queued on the copy stream (the latest fill's end event: one
        stream, in order). Outside the step path only: discard, close."""
        ev = self.last_copy
        if ev is not None and not ev.query():
            ev.synchronize()

    def _orphan(self, job: Job) -> bool:
        """A job that never reached the loader (Ctrl-C between `self._job = job` and the queue)."""
        with self._cv:
            return not job.done and not job.started and job not in self._queues["copy"]

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every loader thread waits for a buffer the consumer must free (or for a job): all that
        can be read ahead is loaded. False on timeout. For tests and benchmarks."""
        with self._cv:
            return self._cv.wait_for(self._quiet, timeout)

    def _quiet(self) -> bool:
        if any(q for q in self._queues.values()):
            return False
        return all(stage in self._waiting and not self._waiting[stage]() for stage in self._threads)

    def loaded(self) -> list[int]:
        """Layer ids held ahead of the consumer now: the slots in fill order, then the bounce ring."""
        with self._cv:
            slots = sorted((b for b in self.slots if b.full), key=lambda b: self._job.ids.index(b.layer)
                           if self._job is not None and b.layer in self._job.ids else -1)
            return [b.layer for b in slots] + sorted(b.layer for b in self.bounce if b.full)

    def close(self) -> None:
        """Stop the loader threads (the pager can still be used: new threads start on demand)."""
        if self._job is not None:
            self._cancel(self._job)
        self._fence()
        with self._cv:
            for q in self._queues.values():
                q.append(None)
            self._cv.notify_all()
        for t in self._threads.values():
            t.join()
        with self._cv:
            self._threads, self._crashed = {}, None
            for q in self._queues.values():
                q.clear()

    def __enter__(self) -> "LayerPager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- timings

    def counters(self) -> dict[str, float]:
        """Cumulative counters since the pager was made (a Profiler stream source: bytes_streamed, copy_s,
        stall_s, plus per-tier bytes/copy seconds, compute_s, pass_s, busy_s, passes). Never reset: callers
        diff two snapshots (stream_summary). Never waits: passes still running on the device count later."""
        return self.collect().totals()

    def collect(self, wait: bool = False) -> PagerStats:
        """Fold every pass whose events have completed into self.stats, in order, and return the stats.
        wait=True also waits for the remaining passes' own events (not a device-wide synchronize); only
        callers outside the step path (benchmarks, end of a run) should ask."""
        with self._stats_lock:
            while self._pending:
                p = self._pending[0]
                if not p.ready():
                    if not wait:
                        break
                    p.synchronize()
                fold(self.stats, self._pending.popleft())
        return self.stats


def build_pager(tiers: Sequence[str], reader: LayerReader, device: torch.device | str, n_slots: int = 2,
                n_bounce: int = 2, bind: Bind | None = None, staged: bool | None = None,
                heads: Sequence[int] | None = None) -> LayerPager:
    """A pager for layers 0..len(tiers)-1 with layer i in tiers[i] ("resident" | "ram" | "ssd"): the resident
    and RAM tiers are allocated (one region each; RAM pinned on CUDA) and filled from `reader` now (a layer
    cache checks each layer's checksum as it is read); the SSD tier reads from `reader` on demand. heads: what
    the read-ahead moves of each layer (see the module docstring; default the whole layer)."""
    device = torch.device(device)
    bad = sorted(set(tiers) - {"resident", "ram", "ssd"})
    if bad:
        raise ValueError(f"unknown tier {bad[0]!r}; tiers are resident, ram, ssd")
    sizes = [reader.nbytes(i) for i in range(len(tiers))]
    by_tier = {t: {i: sizes[i] for i, ti in enumerate(tiers) if ti == t} for t in ("resident", "ram")}
    resident = ResidentTier(by_tier["resident"], device) if by_tier["resident"] else None
    ram = RamTier(by_tier["ram"], pin=device.type == "cuda") if by_tier["ram"] else None
    for tier in (resident, ram):
        if tier is not None:
            fill(tier.buffers, reader)
    ssd_ids = [i for i, t in enumerate(tiers) if t == "ssd"]
    return LayerPager(sizes, device, resident, ram, reader, ssd_ids, n_slots, n_bounce, bind, staged, heads)
