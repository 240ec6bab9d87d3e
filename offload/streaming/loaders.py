"""The loader threads of a LayerPager, and the state they share with it (slot and bounce Buffers, pass Jobs).

- the copier (`_copy_loop`), in layer order: slot k % n_slots gets the k-th streamed layer of a pass, from the
  RAM tier (on CUDA an async H2D copy on the pager's copy stream), from a bounce buffer, or on the CPU straight
  from the disk; then the layer's companion bytes (see pager.py);
- the reader (`_read_loop`, staged SSD only): reads SSD layers into the ring of bounce buffers, as far ahead as
  it has free ones, independently of the slots.
Both take Jobs from their queue and wait on the pager's condition variable, checking for cancellation every
WAIT_TICK seconds; a failure is handed to the Job, and the consumer raises it.

Each moves a layer's head (pager `heads`: the whole layer unless the pager streams it in parts, parts.py).

`Loaders` is the loader half of LayerPager (a mixin): it uses the pager's slots, bounce, tiers, sizes, heads, ram,
ssd, copy_stream, companion, stats, last_copy, _cv, _queues, _waiting, _threads, _stats_lock and _event,
all set or defined by LayerPager.

Does not know: the consumer side (which pass is running, handing layers out, cancelling: pager.py), timing
folds (timing.py), what the bytes mean.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from offload.streaming.parts import read_head
from offload.streaming.timing import LayerTiming

WAIT_TICK = 0.05                                    # seconds between checks for cancellation while waiting


class Buffer:
    """A slot (device memory; host memory on CPU) or a bounce buffer (host), and what it holds. Its state is
    guarded by the pager's condition variable."""

    __slots__ = ("buf", "full", "layer", "job", "timing", "used")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.full, self.layer, self.job = False, -1, None
        self.timing: LayerTiming | None = None      # slot: how it was filled
        self.used: Any = None                       # slot: after the compute that last read it; bounce: after
                                                    # the copy out of it (an event; None before first use)

    def holds(self, job: "Job", i: int) -> bool:
        return self.full and self.job is job and self.layer == i

    def empty(self) -> None:
        self.full, self.layer, self.job, self.timing = False, -1, None, None


class Job:
    """The streamed layers of one pass, in order, and (staged) its SSD layers for the reader."""

    def __init__(self, ids: list[int], ssd: Sequence[int] = ()) -> None:
        self.ids, self.ssd = ids, list(ssd)
        self.cancelled = False
        self.error: BaseException | None = None
        self.error_layer = -1
        self.stages = 0             # loader threads still working on it (set when the copier takes it)
        self.started = False        # the copier has taken it off the queue
        self.done = False           # no loader thread touches it any more
        self.taken = False          # a pass consumes it

    @property
    def stopped(self) -> bool:
        return self.cancelled or self.error is not None


class Loaders:
    """The copier and reader threads of a LayerPager (see the module docstring)."""

    def _start_threads(self) -> None:
        stages = {"copy": self._copy_loop, "read": self._read_loop} if self.staged else {"copy": self._copy_loop}
        for stage, target in stages.items():
            if stage not in self._threads:
                self._threads[stage] = threading.Thread(target=self._guarded, args=(stage, target),
                                                        name="layer-pager", daemon=True)
                self._threads[stage].start()

    def _guarded(self, stage: str, loop: Callable[[], None]) -> None:
        """A loader thread's body. A loop that dies outside a job's own error handling leaves its error in
        `_crashed` for the waiting pass to raise, instead of a consumer that waits for a slot forever."""
        try:
            loop()
        except BaseException as error:
            with self._cv:
                self._crashed = (stage, error)       # raised, with its traceback, by the pass (`from error`)
                self._cv.notify_all()

    def _next(self, stage: str) -> Job | None:
        """The stage's next job (None: stop). The copier hands a job with SSD layers on to the reader."""
        queue = self._queues[stage]
        with self._cv:
            while not queue:
                self._waiting[stage] = lambda: bool(queue)
                self._cv.notify_all()
                self._cv.wait()
                self._waiting.pop(stage, None)
            job = queue.popleft()
            if job is not None and stage == "copy":
                job.started = True
                job.stages = 2 if job.ssd else 1
                if job.ssd:
                    self._queues["read"].append(job)
                    self._cv.notify_all()
            return job

    def _await(self, stage: str, ready: Callable[[], bool], job: Job) -> bool:
        """(cv held) Wait until ready(); False if the job stops first."""
        while not ready() and not job.stopped:
            self._waiting[stage] = ready
            self._cv.notify_all()
            self._cv.wait(WAIT_TICK)
            self._waiting.pop(stage, None)
        return not job.stopped

    def _finish(self, job: Job) -> None:
        with self._cv:
            job.stages -= 1
            if job.stages <= 0:
                job.done = True
            self._cv.notify_all()

    def _fail(self, job: Job, i: int, error: BaseException) -> None:
        with self._cv:
            if job.error is None:
                job.error, job.error_layer = error, i
            self._cv.notify_all()

    def _copy_loop(self) -> None:
        device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with device:
            self._run_jobs("copy", self._copy_job)

    def _copy_job(self, job: Job) -> None:
        """Fill slot k % n_slots with the k-th layer, in order, as slots (and staged SSD layers) become ready."""
        m = 0
        for k, i in enumerate(job.ids):
            slot, bounce = self.slots[k % len(self.slots)], None
            with self._cv:
                if not self._await("copy", lambda: not slot.full, job):
                    return
                if job.ssd and self.tiers[i] == "ssd":
                    bounce = self.bounce[m % len(self.bounce)]
                    m += 1
                    if not self._await("copy", lambda: bounce.full, job):
                        return
                    if not bounce.holds(job, i):
                        self._fail(job, i, RuntimeError(f"bounce buffer holds layer {bounce.layer}, expected {i}"))
                        return
            try:
                lt = self._fill(i, k % len(self.slots), bounce, job)
            except BaseException as e:          # noqa: BLE001 -- handed to the consumer, which raises it
                self._fail(job, i, e)
                return
            with self._cv:
                if bounce is not None:
                    bounce.used = lt.copy_end
                    bounce.empty()
                if self.copy_stream is not None:
                    self.last_copy = lt.copy_end
                slot.full, slot.layer, slot.job, slot.timing = True, i, job, lt
                self._cv.notify_all()

    def _fill(self, i: int, slot_index: int, bounce: Buffer | None, job: Job) -> LayerTiming:
        """Move layer i into the slot (from the RAM tier, the bounce buffer, or the disk on CPU), then its
        companion's bytes; its timing."""
        tier, n, slot = self.tiers[i], self.heads[i], self.slots[slot_index]
        dst = slot.buf[:n]
        if tier == "ssd" and bounce is None:                      # CPU: the disk read fills the slot
            lt = LayerTiming("ssd", copy_start=self._event())
            read_head(self.ssd, i, n, self.sizes[i], slot.buf)
            lt.companion_bytes = self._companion(i, slot_index, job)
            lt.copy_end = self._event()
            return lt
        src = bounce.buf[:n] if bounce is not None else self.ram.buffer(i)[:n]
        lt = LayerTiming(tier, count_copy=bounce is None)        # staged SSD: the disk read is the tier's time
        stream = self.copy_stream
        if stream is None:
            lt.copy_start = self._event()
            dst.copy_(src)
            lt.companion_bytes = self._companion(i, slot_index, job)
            lt.copy_end = self._event()
            return lt
        if slot.used is not None:
            stream.wait_event(slot.used)                          # the compute that last read the slot is done
        lt.copy_start = self._event(stream)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            lt.companion_bytes = self._companion(i, slot_index, job)
        lt.copy_end = self._event(stream)
        return lt

    def _companion(self, i: int, slot_index: int, job: Job) -> int:
        companion = self.companion
        return companion(i, slot_index, lambda: job.stopped) if companion is not None else 0

    def _read_loop(self) -> None:
        self._run_jobs("read", self._read_job)

    def _run_jobs(self, kind: str, work: Callable[[Job], None]) -> None:
        """One thread's loop: run `work` on each job handed to `kind` until there are no more, finishing each
        job whatever happens to it."""
        while (job := self._next(kind)) is not None:
            try:
                work(job)
            finally:
                self._finish(job)

    def _read_job(self, job: Job) -> None:
        """Read the job's SSD layers, in order, into the bounce ring as far ahead as it has free buffers."""
        for m, i in enumerate(job.ssd):
            b = self.bounce[m % len(self.bounce)]
            with self._cv:
                if not self._await("read", lambda: not b.full, job):
                    return
            try:
                if b.used is not None:
                    b.used.synchronize()                          # the copy out of it finished (this thread waits)
                t0 = time.perf_counter()
                read_head(self.ssd, i, self.heads[i], self.sizes[i], b.buf)
            except BaseException as e:          # noqa: BLE001 -- handed to the consumer, which raises it
                self._fail(job, i, e)
                return
            with self._stats_lock:
                self.stats.copy_s["ssd"] += time.perf_counter() - t0
            with self._cv:
                b.full, b.layer, b.job = True, i, job
                self._cv.notify_all()
