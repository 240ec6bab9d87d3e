"""LayerPager: hands out packed layers in order, streaming the non-resident ones through N device slots.

`layers(ids)` yields (i, view) for each layer id; a view of a streamed layer lives in a slot and is valid
until the next iteration (then the slot is refilled). A loader thread fills slots ahead of the consumer:
- RAM tier: one copy region -> slot (on CUDA an async H2D copy on the slot's own copy stream);
- SSD tier: a disk read (`LayerReader.read_layer`) straight into the slot on CPU, or into a pinned bounce
  buffer followed by the H2D copy on CUDA.
On CUDA nothing blocks the host: the copy stream waits (event) until the compute that last used the slot is
done, and the compute stream waits (event) until the copy is done, so a copy is issued as soon as its slot is
released and compute never waits on a copy that could have been issued earlier. `prefetch_start()` (called
after a pass, while the draft grows its tree) starts loading the first layers of the next pass.

PagerStats: bytes moved per tier, copy time per tier, compute time, stall time (compute waiting for a layer).

Does not know: what the bytes mean (the caller's `bind` turns a buffer into views or a module), which layer
goes in which tier (planner.py), models or tokens.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .tiers import LayerReader, RamTier, ResidentTier, fill, host_buffer

Bind = Callable[[int, int, torch.Tensor], Any]      # (layer, slot or -1 when resident, uint8 buffer) -> view
WAIT_TICK = 0.05                                    # seconds between checks for cancellation while waiting
MAX_PENDING_TIMINGS = 4096                          # CUDA timing events folded into the stats beyond this


@dataclass
class PagerStats:
    """Counters since the last reset(). Times in seconds; bytes per streaming tier ("ram", "ssd")."""

    bytes: dict[str, int] = field(default_factory=lambda: {"ram": 0, "ssd": 0})
    copy_s: dict[str, float] = field(default_factory=lambda: {"ram": 0.0, "ssd": 0.0})
    compute_s: float = 0.0
    stall_s: float = 0.0
    pass_s: float = 0.0
    passes: int = 0
    layers: int = 0

    @property
    def streamed(self) -> int:
        return sum(self.bytes.values())

    def totals(self) -> dict[str, float]:
        """Flat cumulative counters (see LayerPager.counters)."""
        return {"bytes_streamed": self.streamed, "copy_s": sum(self.copy_s.values()), "stall_s": self.stall_s,
                "ram_bytes": self.bytes["ram"], "ssd_bytes": self.bytes["ssd"], "ram_copy_s": self.copy_s["ram"],
                "ssd_copy_s": self.copy_s["ssd"], "compute_s": self.compute_s, "pass_s": self.pass_s,
                "passes": self.passes}

    def summary(self) -> dict:
        return stream_summary({}, self.totals())


def stream_summary(before: dict[str, float], after: dict[str, float]) -> dict:
    """What happened between two `counters()` snapshots, JSON-able: bytes_streamed, passes, stall_ms,
    copy_ms, compute_ms, effective_gbps (bytes / time in passes) and per tier used: <tier>_bytes and
    <tier>_gbps (bytes / time spent moving that tier's bytes: the link's rate while busy)."""
    d = {k: v - before.get(k, 0) for k, v in after.items()}
    out = {"bytes_streamed": int(d["bytes_streamed"]), "passes": int(d["passes"]),
           "stall_ms": round(1000 * d["stall_s"], 2), "copy_ms": round(1000 * d["copy_s"], 2),
           "compute_ms": round(1000 * d["compute_s"], 2),
           "effective_gbps": round(d["bytes_streamed"] / d["pass_s"] / 1e9, 3) if d["pass_s"] > 0 else None}
    for tier in ("ram", "ssd"):
        if d[f"{tier}_bytes"]:
            out[f"{tier}_bytes"] = int(d[f"{tier}_bytes"])
            out[f"{tier}_gbps"] = round(d[f"{tier}_bytes"] / max(d[f"{tier}_copy_s"], 1e-9) / 1e9, 3)
    return out


class _Slot:
    """One device buffer sized for the largest streamed layer, with its hand-over state."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device) if cuda else host_buffer(nbytes)
        self.free, self.ready = threading.Event(), threading.Event()
        self.free.set()
        self.layer, self.job = -1, None                          # what the slot holds, filled by which job
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.copied = torch.cuda.Event() if cuda else None      # recorded on self.stream after a fill
        self.released = torch.cuda.Event() if cuda else None    # recorded on the compute stream after use


class _Job:
    """The streamed layers of one pass, in order; the loader fills slot k % n with the k-th."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.taken = False
        self.started = False        # the loader has taken it off the queue


class LayerPager:
    """Layers by id from a ResidentTier (used in place), a RamTier and/or an SSD LayerSource (streamed)."""

    def __init__(self, sizes: Sequence[int], device: torch.device | str, resident: ResidentTier | None = None,
                 ram: RamTier | None = None, ssd: LayerReader | None = None, ssd_ids: Sequence[int] = (),
                 n_slots: int = 2, n_bounce: int = 2, bind: Bind | None = None) -> None:
        self.device = torch.device(device)
        self.sizes = list(sizes)
        self.resident, self.ram, self.ssd = resident, ram, ssd
        self.tiers = [self._tier(i, set(ssd_ids)) for i in range(len(self.sizes))]
        self.bind: Bind = bind or (lambda i, slot, buf: buf)
        self.stats = PagerStats()
        streamed = [self.sizes[i] for i, t in enumerate(self.tiers) if t != "resident"]
        self.slot_bytes = max(streamed, default=0)
        self.slots = [_Slot(self.slot_bytes, self.device) for _ in range(n_slots if streamed else 0)]
        if streamed and n_slots < 1:
            raise ValueError("streamed layers need at least one slot")
        cuda_ssd = self.device.type == "cuda" and "ssd" in self.tiers
        self.bounce = [host_buffer(self.slot_bytes, pin=True) for _ in range(max(n_bounce, 1) if cuda_ssd else 0)]
        self.bounce_done = [torch.cuda.Event() for _ in self.bounce]
        self._n_bounce_used = 0
        self._timings: list[tuple[str, Any, Any]] = []            # CUDA (kind, start event, end event)
        self._timings_lock = threading.Lock()
        self._job: _Job | None = None
        self._last_ids: list[int] = list(range(len(self.sizes)))
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def _tier(self, i: int, ssd_ids: set[int]) -> str:
        if self.resident is not None and i in self.resident.buffers:
            return "resident"
        if self.ram is not None and i in self.ram.buffers:
            return "ram"
        if i in ssd_ids and self.ssd is not None:
            return "ssd"
        raise ValueError(f"layer {i} is in no tier (resident, ram, or an ssd source with it in ssd_ids)")

    def tier_of(self, i: int) -> str:
        return self.tiers[i]

    # ------------------------------------------------------------------------------------- consumer side

    def layers(self, ids: Sequence[int] | None = None) -> Iterator[tuple[int, Any]]:
        """(i, bind(i, slot, buffer)) for each id in order; a streamed layer's buffer is valid until the next
        iteration. Leaving the loop early cancels the read-ahead."""
        ids = list(range(len(self.sizes))) if ids is None else list(ids)
        streamed = [i for i in ids if self.tiers[i] != "resident"]
        job = self._take(streamed)
        if self.device.type == "cuda":
            if len(self._timings) > MAX_PENDING_TIMINGS:
                self.collect()
            self._timed("pass", None, None)
        t_pass, k, finished = time.perf_counter(), 0, False
        try:
            for i in ids:
                if self.tiers[i] == "resident":
                    buf = self.resident.buffer(i)[:self.sizes[i]]
                    yield from self._serve(i, -1, buf)
                    continue
                slot_index = k % len(self.slots)
                slot = self.slots[slot_index]
                self._acquire(slot, job, i)
                yield from self._serve(i, slot_index, slot.buf[:self.sizes[i]])
                self._release(slot)
                k += 1
            finished = True
        finally:
            if not finished:
                self._cancel(job)
            self._last_ids = ids
            self.stats.passes += 1
            self.stats.pass_s += time.perf_counter() - t_pass

    def _serve(self, i: int, slot: int, buf: torch.Tensor) -> Iterator[tuple[int, Any]]:
        """Yield one layer and count the time until the consumer comes back as compute."""
        start = self._mark()
        t0 = time.perf_counter()
        yield i, self.bind(i, slot, buf)
        if start is None:
            self.stats.compute_s += time.perf_counter() - t0
        else:
            self._timed("compute", start, self._mark())
        self.stats.layers += 1

    def _acquire(self, slot: _Slot, job: _Job, i: int) -> None:
        """Wait (host) until the loader filled `slot` with layer i; on CUDA make compute wait for the copy."""
        if not slot.ready.is_set():
            t0 = time.perf_counter()
            while not slot.ready.wait(WAIT_TICK):
                if job.done.is_set() and not slot.ready.is_set():
                    break
            self.stats.stall_s += time.perf_counter() - t0
        if slot.job is not job or slot.layer != i:
            if job.error is not None:
                raise RuntimeError(f"loading layer {i} failed: {job.error}") from job.error
            raise RuntimeError(f"pager slot holds layer {slot.layer}, expected {i} (loader out of step)")
        slot.ready.clear()
        if slot.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.copied)

    def _release(self, slot: _Slot) -> None:
        if slot.released is not None:
            slot.released.record(torch.cuda.current_stream(self.device))
        slot.free.set()

    def _mark(self) -> Any:
        """A CUDA event recorded on the compute stream now (None on CPU)."""
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    # ------------------------------------------------------------------------------------- jobs

    def prefetch_start(self, ids: Sequence[int] | None = None) -> None:
        """Start loading the streamed layers of the next pass (default: the same ids as the last pass) into
        the free slots now, e.g. while the draft grows its tree. A no-op when nothing streams or a job is
        already queued for those layers."""
        ids = self._last_ids if ids is None else list(ids)
        streamed = [i for i in ids if self.tiers[i] != "resident"]
        if not streamed or (self._job is not None and not self._job.taken and self._job.ids == streamed):
            return
        self._submit(streamed)

    def _take(self, streamed: list[int]) -> _Job:
        """The queued job if it loads exactly `streamed` and nothing consumed it yet; else a new one."""
        job = self._job
        if job is None or job.taken or job.ids != streamed or self._orphan(job):
            job = self._submit(streamed)
        job.taken = True
        return job

    def _submit(self, streamed: list[int]) -> _Job:
        if self._job is not None and not self._job.done.is_set():
            self._cancel(self._job)
        job = _Job(streamed)
        self._job = job
        if not streamed:
            job.done.set()
            return job
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="layer-pager", daemon=True)
            self._thread.start()
        self._queue.put(job)
        return job

    def _cancel(self, job: _Job) -> None:
        """Stop `job`, wait for the loader to let go of it, and mark every slot free and empty."""
        job.cancelled.set()
        while not job.done.wait(WAIT_TICK):
            if self._orphan(job):                   # nothing will run it; if the loader just took it, it sees
                job.done.set()                      # `cancelled` before touching a slot
        for slot in self.slots:
            slot.ready.clear()
            slot.layer, slot.job = -1, None
            slot.free.set()

    def _orphan(self, job: _Job) -> bool:
        """A job that never reached the loader (Ctrl-C between `self._job = job` and put()): not done, not
        started, not queued."""
        if job.done.is_set() or job.started:
            return False
        with self._queue.mutex:
            return job not in self._queue.queue

    def close(self) -> None:
        """Stop the loader thread (the pager can still be used: a new thread starts on demand)."""
        if self._job is not None:
            self._cancel(self._job)
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "LayerPager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------- loader side

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            job.started = True
            try:
                self._run(job)
            except BaseException as e:          # noqa: BLE001 -- handed to the consumer, which raises it
                job.error = e
            finally:
                job.done.set()
                for slot in self.slots:          # wake a waiting consumer (it checks job.error / layer)
                    if job.error is not None:
                        slot.ready.set()

    def _run(self, job: _Job) -> None:
        n = len(self.slots)
        for k, i in enumerate(job.ids):
            slot = self.slots[k % n]
            while not slot.free.wait(WAIT_TICK):
                if job.cancelled.is_set():
                    return
            if job.cancelled.is_set():
                return
            slot.free.clear()
            slot.layer, slot.job = -1, None
            self._fill(i, slot)
            slot.layer, slot.job = i, job
            slot.ready.set()

    def _fill(self, i: int, slot: _Slot) -> None:
        tier, n = self.tiers[i], self.sizes[i]
        dst = slot.buf[:n]
        t0 = time.perf_counter()
        if slot.stream is None:                                   # CPU: synchronous, in this thread
            if tier == "ram":
                dst.copy_(self.ram.buffer(i)[:n])
            else:
                self.ssd.read_layer(i, dst)
        elif tier == "ram":
            self._copy_async(slot, dst, self.ram.buffer(i)[:n], "ram")
        else:
            b = self._n_bounce_used % len(self.bounce)
            self._n_bounce_used += 1
            self.bounce_done[b].synchronize()                     # the last H2D copy out of it is done
            self.ssd.read_layer(i, self.bounce[b][:n])
            self.stats.copy_s["ssd"] += time.perf_counter() - t0
            self._copy_async(slot, dst, self.bounce[b][:n], None)
            self.bounce_done[b].record(slot.stream)
        if slot.stream is None:
            self.stats.copy_s[tier] += time.perf_counter() - t0
        self.stats.bytes[tier] += n

    def _copy_async(self, slot: _Slot, dst: torch.Tensor, src: torch.Tensor, timed: str | None) -> None:
        """H2D copy on the slot's stream after the compute that last used the slot; records slot.copied."""
        stream = slot.stream
        stream.wait_event(slot.released)
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True) if timed else None
            if start is not None:
                start.record(stream)
            dst.copy_(src, non_blocking=True)
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                self._timed(timed, start, end)
        slot.copied.record(stream)

    def counters(self) -> dict[str, float]:
        """Cumulative counters since the pager was made (a Profiler stream source: bytes_streamed, copy_s,
        stall_s, plus per-tier bytes/copy seconds, compute_s, pass_s, passes). Never reset: callers diff
        two snapshots (stream_summary)."""
        return self.collect().totals()

    # ------------------------------------------------------------------------------------- CUDA timings

    def _timed(self, kind: str, start: Any, end: Any) -> None:
        with self._timings_lock:
            self._timings.append((kind, start, end))

    def collect(self) -> PagerStats:
        """Fold finished CUDA event timings into self.stats (copy time per tier, compute time, and stall =
        gaps on the compute stream between the layers of a pass) and return the stats. A no-op on CPU."""
        with self._timings_lock:
            timings, self._timings = self._timings, []
        if not timings:
            return self.stats
        torch.cuda.synchronize(self.device)
        last_end = None
        for kind, start, end in timings:
            if kind == "pass":
                last_end = None
                continue
            seconds = start.elapsed_time(end) / 1000
            if kind == "compute":
                self.stats.compute_s += seconds
                if last_end is not None:
                    self.stats.stall_s += max(last_end.elapsed_time(start) / 1000, 0.0)
                last_end = end
            else:
                self.stats.copy_s[kind] += seconds
        return self.stats


def build_pager(tiers: Sequence[str], reader: LayerReader, device: torch.device | str, n_slots: int = 2,
                n_bounce: int = 2, bind: Bind | None = None) -> LayerPager:
    """A pager for layers 0..len(tiers)-1 with layer i in tiers[i] ("resident" | "ram" | "ssd"): the resident
    and RAM tiers are allocated (one region each; RAM pinned on CUDA) and filled from `reader` now; the SSD
    tier reads from `reader` on demand."""
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
    return LayerPager(sizes, device, resident, ram, reader, ssd_ids, n_slots, n_bounce, bind)
