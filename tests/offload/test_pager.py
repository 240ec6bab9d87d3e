"""offload.streaming.pager and offload.streaming.tiers on random packed bytes: every tier mix hands out the exact bytes
in order, stats count what moved, read-ahead overlaps a slow reader with compute, cancellation and errors are clean, the
SSD file reads with and without O_DIRECT (and without any POSIX-only facility: conftest.posix_facilities). `gpu` tests
cover pinned memory (and its fallback), copy streams and events."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from offload.cache.packed import write_packed
from offload.streaming.pager import LayerPager, build_pager
from offload.streaming.timing import HostEvent, LayerTiming, PagerStats, PassTiming, fold
from offload.streaming.storage import ALIGN, LayerLayout
from offload.streaming import tiers
from offload.streaming.tiers import RamTier, ResidentTier, fill, host_buffer, probe_copy, probe_read, split
from offload.streaming.timing import stream_summary
from tests.offload.lag_event import LagEvent

SIZES = [3 * ALIGN, 2 * ALIGN, 5 * ALIGN, ALIGN, 4 * ALIGN, 2 * ALIGN]


class MemoryReader:
    """A LayerReader over in-memory buffers, optionally slow (sleeping releases the GIL like a disk read)."""

    def __init__(self, buffers: list[torch.Tensor], delay: float = 0.0, fail_at: int | None = None) -> None:
        self.buffers, self.delay, self.fail_at, self.reads = buffers, delay, fail_at, []

    def nbytes(self, i: int) -> int:
        return self.buffers[i].numel()

    def read_layer(self, i: int, out: torch.Tensor) -> None:
        if i == self.fail_at:
            raise OSError(f"read error on layer {i}")
        time.sleep(self.delay)
        out[:self.buffers[i].numel()].copy_(self.buffers[i])
        self.reads.append(i)


@pytest.fixture(scope="module")
def layers() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in SIZES]


def check_pass(pager: LayerPager, layers: list[torch.Tensor], ids: list[int] | None = None) -> None:
    ids = list(range(len(layers))) if ids is None else ids
    seen = []
    for i, buf in pager.layers(ids):
        assert torch.equal(buf, layers[i]), f"layer {i}"
        seen.append(i)
    assert seen == ids


MIXES = {
    "resident": ["resident"] * 6,
    "ram": ["ram"] * 6,
    "ssd": ["ssd"] * 6,
    "mixed": ["resident", "ram", "ssd", "ssd", "ram", "resident"],
}


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("n_slots", [1, 2, 3])
def test_every_tier_mix_serves_exact_bytes_and_counts_them(layers, mix: str, n_slots: int, staged: bool) -> None:
    """staged: the CUDA path's SSD reader -> bounce ring -> copier -> slot pipeline, run on host buffers."""
    tiers = MIXES[mix]
    with build_pager(tiers, MemoryReader(layers), "cpu", n_slots=n_slots, n_bounce=2, staged=staged) as pager:
        assert pager.staged == (staged and "ssd" in tiers)
        assert pager.tiers == tiers
        for _ in range(3):
            check_pass(pager, layers)
        check_pass(pager, layers, [5, 2, 0, 3])                  # another order, a subset
        streamed = {t: sum(n for n, ti in zip(SIZES, tiers) if ti == t) for t in ("ram", "ssd")}
        subset = {t: sum(SIZES[i] for i in (5, 2, 0, 3) if tiers[i] == t) for t in ("ram", "ssd")}
        assert pager.stats.bytes == {t: 3 * streamed[t] + subset[t] for t in ("ram", "ssd")}
        assert pager.stats.passes == 4 and pager.stats.layers == 22


def test_prefetch_loads_the_next_pass_once(layers) -> None:
    reader = MemoryReader(layers)
    with build_pager(["ssd"] * 6, reader, "cpu", n_slots=2) as pager:
        check_pass(pager, layers)
        pager.prefetch_start()
        pager.prefetch_start()                                    # idempotent while queued
        deadline = time.time() + 5
        while len(reader.reads) < 8 and time.time() < deadline:   # the first 2 layers of the next pass arrive
            time.sleep(0.01)
        assert reader.reads == list(range(6)) + [0, 1]
        check_pass(pager, layers)                                 # uses the prefetched job
        assert reader.reads == list(range(6)) * 2
        assert pager.stats.bytes["ssd"] == 2 * sum(SIZES)


DEPTHS = [(1, 0, False), (2, 0, False), (3, 0, False), (5, 0, False), (1, 1, True), (2, 1, True),
          (1, 3, True), (2, 3, True), (4, 4, True)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n_slots,n_bounce,staged", DEPTHS)
def test_read_ahead_fills_every_buffer_before_the_next_pass(layers, n_slots: int, n_bounce: int,
                                                             staged: bool) -> None:
    """With depth D (slots, plus the bounce ring when staged), prefetch_start() loads exactly the next pass's
    first D layers with nobody consuming (what happens while the draft grows its tree), in order; the pass
    then reads each layer once and gets the right bytes."""
    n, order = len(layers), [3, 1, 4, 0, 5, 2]
    reader = MemoryReader(layers)
    with build_pager(["ssd"] * n, reader, "cpu", n_slots=n_slots, n_bounce=n_bounce, staged=staged) as pager:
        depth = n_slots + (n_bounce if staged else 0)
        assert pager.depth == depth and len(pager.slots) == n_slots and len(pager.bounce) == (n_bounce if staged else 0)
        assert all(b.buf.numel() == max(SIZES) for b in pager.slots + pager.bounce)   # what the plan budgets
        check_pass(pager, layers, order)
        assert pager.wait_idle(10) and reader.reads == order
        pager.prefetch_start()                                    # the next pass: the same layers
        assert pager.wait_idle(10)                                # every thread now waits for the consumer
        ahead = order[:min(depth, n)]
        assert reader.reads == order + ahead and sorted(pager.loaded()) == sorted(ahead)
        assert pager.loaded()[:min(n_slots, n)] == ahead[:n_slots]          # the slots hold the first ones
        check_pass(pager, layers, order)
        assert reader.reads == order * 2 and pager.stats.bytes["ssd"] == 2 * sum(SIZES)


@pytest.mark.timeout(60)
def test_interleaved_resident_layers_keep_the_link_busy() -> None:
    """The planner's CUDA tiers (offload.planner.interleave) against resident layers all first, in a pager whose
    reader is slow: counted at each resident layer, how often the link has nothing to do although the pass still
    has layers to load (every slot full, filled while the 'draft' ran). All first: every resident layer idles
    the link; spread: none does (the layer before it freed a slot that is being refilled)."""
    from offload.memory_plan import Needs
    from offload.planner import plan

    n, size = 12, 2 * ALIGN
    p = plan(Needs((size,) * n, (("draft", 0),), 2, 2), "cuda", ram_budget=10**9, gpu_budget=6 * size)
    spread = tuple("ssd" if t != "resident" else t for t in p.tiers)
    k = spread.count("resident")
    assert 0 < k < n - 2
    data = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
            for i in range(n)]

    def idle_resident_layers(tiers: tuple[str, ...]) -> int:
        idle = 0
        with build_pager(list(tiers), MemoryReader(data, delay=0.02), "cpu", n_slots=2) as pager:
            pager.prefetch_start()
            assert pager.wait_idle(10)                         # the slots filled while the draft grew its tree
            served = 0
            for i, buf in pager.layers():
                assert torch.equal(buf[:size], data[i])
                if tiers[i] != "resident":
                    served += 1
                elif served + len(pager.slots) < n - k and all(b.full for b in pager.slots):
                    idle += 1                                  # work left, yet nothing to copy into
        return idle

    assert idle_resident_layers(("resident",) * k + ("ssd",) * (n - k)) == k
    assert idle_resident_layers(spread) == 0


def test_close_stops_both_loader_threads_and_they_restart_on_demand(layers) -> None:
    def pager_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "layer-pager" and t.is_alive()}

    before = pager_threads()
    pager = build_pager(["ssd"] * 6, MemoryReader(layers), "cpu", staged=True)
    check_pass(pager, layers)
    pager.prefetch_start()                                        # both threads busy with the next pass
    mine = pager_threads() - before
    assert len(mine) == 2
    pager.close()
    assert not any(t.is_alive() for t in mine)
    check_pass(pager, layers)
    assert len(pager_threads() - before) == 2
    pager.close()
    assert pager_threads() <= before


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_a_read_error_during_read_ahead_is_raised_by_the_next_pass(layers, staged: bool) -> None:
    """A layer that fails to load while the draft runs is not retried silently: the pass that needed it says
    so (one error), and the pass after that starts clean."""
    reader = MemoryReader(layers)
    with build_pager(["ssd"] * 6, reader, "cpu", n_slots=2, n_bounce=2, staged=staged) as pager:
        check_pass(pager, layers)
        reader.fail_at = 1
        pager.prefetch_start()
        assert pager.wait_idle(10)
        reader.fail_at = None
        with pytest.raises(RuntimeError, match="loading layer 1 failed: read error on layer 1"):
            check_pass(pager, layers)
        check_pass(pager, layers)


def test_the_ram_tier_reads_ahead_as_deep_as_the_slots(layers) -> None:
    with build_pager(["ram"] * 6, MemoryReader(layers), "cpu", n_slots=4) as pager:
        check_pass(pager, layers)
        pager.prefetch_start()
        assert pager.wait_idle(10) and pager.loaded() == [0, 1, 2, 3]
        check_pass(pager, layers)


def test_prefetch_for_other_layers_is_replaced(layers) -> None:
    reader = MemoryReader(layers)
    with build_pager(["ssd"] * 6, reader, "cpu", n_slots=2) as pager:
        pager.prefetch_start([4, 5])
        check_pass(pager, layers, [0, 1, 2])
        check_pass(pager, layers)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_leaving_a_pass_early_cancels_the_read_ahead(layers, staged: bool) -> None:
    reader = MemoryReader(layers, delay=0.01)
    with build_pager(["ssd"] * 6, reader, "cpu", n_slots=2, n_bounce=1, staged=staged) as pager:
        it = pager.layers()
        i, _ = next(it)
        it.close()
        assert i == 0 and len(reader.reads) <= 3 + staged         # at most the buffers were filled
        check_pass(pager, layers)                                 # and the next pass starts clean
        check_pass(pager, layers, [2, 5])


@pytest.mark.timeout(20)
def test_a_job_interrupted_before_it_was_queued_does_not_hang_the_next_pass(layers) -> None:
    from offload.streaming.loaders import Job

    with build_pager(["ssd"] * 6, MemoryReader(layers), "cpu", n_slots=2) as pager:
        check_pass(pager, layers)
        orphan = pager._job = Job(list(range(6)))  # what Ctrl-C between `_job = job` and put() leaves behind
        check_pass(pager, layers)                   # cancels the orphan instead of waiting for it forever
        assert orphan.cancelled and orphan.done and not orphan.started


@pytest.mark.parametrize("stage", ["copy", "read", "read-late"])
def test_a_loader_thread_that_dies_outside_a_job_stops_the_pass_instead_of_hanging_it(
        layers, stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in a loader's own loop (here: taking its next job raises) is raised by the waiting pass, and
    close() leaves a pager whose new threads serve again. "read-late": the reader dies only after the copier
    took the job (the job then waits for two stages, one of them dead: cancelling it hung, a race that a busy
    machine lost). The pass runs in a thread joined with a deadline, so a hang fails this test instead of
    stalling the suite."""
    from offload.streaming.loaders import Loaders

    take = Loaders._next

    def broken(self, which: str):
        if which == stage.removesuffix("-late"):
            if stage.endswith("-late"):
                with self._cv:
                    self._cv.wait_for(lambda: self._job is not None and self._job.started, 10)
            raise AssertionError(f"bug in the {which} loop")
        return take(self, which)

    with build_pager(["ssd"] * 6, MemoryReader(layers), "cpu", n_slots=2, staged=True) as pager:
        monkeypatch.setattr(Loaders, "_next", broken)
        raised: list[BaseException] = []

        def run() -> None:
            try:
                check_pass(pager, layers)
            except BaseException as e:           # noqa: BLE001 -- the test inspects it
                raised.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "the pass hung on a dead loader thread"
        assert len(raised) == 1 and isinstance(raised[0], RuntimeError)
        assert f"layer pager's {stage.removesuffix('-late')} thread stopped" in str(raised[0])
        assert "bug in the" in str(raised[0])
        monkeypatch.setattr(Loaders, "_next", take)
        pager.close()
        check_pass(pager, layers)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_a_read_error_reaches_the_consumer_and_the_pager_recovers(layers, staged: bool) -> None:
    reader = MemoryReader(layers, fail_at=3)
    with build_pager(["ssd"] * 6, reader, "cpu", n_bounce=3, staged=staged) as pager:
        with pytest.raises(RuntimeError, match="loading layer 3 failed: read error on layer 3"):
            check_pass(pager, layers)
        reader.fail_at = None
        check_pass(pager, layers)


class StartedReader(MemoryReader):
    """A MemoryReader that also signals when the read of each layer starts and when it is done."""

    def __init__(self, buffers: list[torch.Tensor], delay: float = 0.0) -> None:
        super().__init__(buffers, delay)
        self.started = [threading.Event() for _ in buffers]
        self.finished = [threading.Event() for _ in buffers]

    def read_layer(self, i: int, out: torch.Tensor) -> None:
        self.started[i].set()
        super().read_layer(i, out)
        self.finished[i].set()


def test_read_ahead_overlaps_a_slow_reader_with_compute(layers) -> None:
    """While layer i is in use, layer i + 1 is read from start to end (events, no clock): the consumer never
    waits for a read but the first. A serial pager reads i + 1 only when asked for it: the waits time out."""
    delay, n = 0.02, 6
    reader = StartedReader(layers, delay=delay)
    with build_pager(["ssd"] * n, reader, "cpu", n_slots=2) as pager:
        ahead = []
        for i, buf in pager.layers():
            assert torch.equal(buf, layers[i])
            if i + 1 < n:
                ahead.append(reader.started[i + 1].wait(10) and reader.finished[i + 1].wait(10))
        assert ahead == [True] * (n - 1)                          # every next read ran while layer i was in use
        assert reader.reads == list(range(n))
        assert pager.stats.copy_s["ssd"] >= 0.9 * n * delay       # each read took at least its sleep


def test_stall_time_counts_waiting_for_a_slow_tier(layers) -> None:
    delay = 0.03
    with build_pager(["ssd"] * 6, MemoryReader(layers, delay=delay), "cpu") as pager:
        check_pass(pager, layers)
        assert pager.stats.stall_s >= 0.8 * 6 * delay
        summary = pager.stats.summary()
        assert summary["bytes_streamed"] == sum(SIZES) and summary["ssd_bytes"] == sum(SIZES)
        assert summary["stall_ms"] >= 0.8 * 6 * delay * 1000 and "ssd_gbps" in summary


def test_counters_diff_into_a_summary(layers) -> None:
    with build_pager(["resident", "ram", "ssd", "ssd", "ram", "resident"], MemoryReader(layers), "cpu") as pager:
        check_pass(pager, layers)
        before = pager.counters()
        check_pass(pager, layers)
        s = stream_summary(before, pager.counters())
        assert s["passes"] == 1
        assert s["ram_bytes"] == SIZES[1] + SIZES[4] and s["ssd_bytes"] == SIZES[2] + SIZES[3]
        assert s["bytes_streamed"] == s["ram_bytes"] + s["ssd_bytes"] and s["effective_gbps"] > 0


def test_bind_turns_buffers_into_views(layers) -> None:
    calls = []

    def bind(i: int, slot: int, buf: torch.Tensor) -> tuple[int, int]:
        calls.append((i, slot))
        return i, int(buf[0])

    with build_pager(["resident", "ssd", "ssd", "ssd", "ram", "resident"], MemoryReader(layers), "cpu",
                     n_slots=2, bind=bind) as pager:
        got = list(pager.layers())
    assert got == [(i, (i, int(layers[i][0]))) for i in range(6)]
    assert calls == [(0, -1), (1, 0), (2, 1), (3, 0), (4, 1), (5, -1)]


def test_timings_fold_only_once_their_events_completed(layers) -> None:
    clock = SimpleNamespace(done=False, waits=0)
    with build_pager(["ram", "ssd", "resident", "ram", "ssd", "ram"], MemoryReader(layers), "cpu") as pager:
        pager._event = lambda stream=None: LagEvent(clock).record()
        check_pass(pager, layers)
        pager.counters()
        check_pass(pager, layers)
        s = pager.counters()
        assert s["passes"] == 2 and pager.stats.folded == 0 and s["pass_s"] == s["stall_s"] == 0.0
        assert s["bytes_streamed"] == 2 * sum(n for n, t in zip(SIZES, pager.tiers) if t != "resident")
        assert clock.waits == 0                                   # counting never waited for the device
        clock.done = True
        s = pager.counters()
        assert pager.stats.folded == 2 and s["pass_s"] > 0 and s["compute_s"] > 0 and clock.waits == 0
        clock.done = False
        check_pass(pager, layers)
        assert pager.collect().folded == 2
        assert pager.collect(wait=True).folded == 3 and clock.waits > 0     # asked to wait: it waits


def test_fold_measures_pass_stall_and_copy_busy_on_the_device_clock() -> None:
    """Times (ms after the pass start): A prefetched before the pass, B's copy ends after A's compute (a
    2 ms stall), C resident, D's copy done before it is needed."""
    def at(ms: float) -> HostEvent:
        ev = HostEvent()
        ev.t = ms / 1000
        return ev

    p = PassTiming(at(0), [
        LayerTiming("ram", at(-5), at(-1), at(0), at(2)),
        LayerTiming("ram", at(1), at(4), at(4), at(6)),
        LayerTiming("resident", compute_start=at(6), compute_end=at(7)),
        LayerTiming("ssd", at(4.5), at(5), at(7), at(8), count_copy=False),
    ])
    stats = PagerStats()
    fold(stats, p)
    assert stats.pass_s == pytest.approx(0.008) and stats.compute_s == pytest.approx(0.006)
    assert stats.stall_s == pytest.approx(0.002) and stats.busy_s == pytest.approx(0.0035)
    assert stats.copy_s == {"ram": pytest.approx(0.007), "ssd": 0.0} and stats.folded == 1
    s = stream_summary({}, {**stats.totals(), "bytes_streamed": 8e6})
    assert s["effective_gbps"] == pytest.approx(1.0) and s["copy_busy"] == pytest.approx(0.438, abs=1e-3)


def test_layer_in_no_tier_is_an_error(layers) -> None:
    with pytest.raises(ValueError, match="layer 2 is in no tier"):
        LayerPager(SIZES, "cpu", ResidentTier({0: SIZES[0], 1: SIZES[1]}, torch.device("cpu")))
    with pytest.raises(ValueError, match="unknown tier"):
        build_pager(["resident", "disk"], MemoryReader(layers), "cpu")


# ------------------------------------------------------------------------------------------------ tiers

def test_host_buffers_are_aligned_and_split_keeps_alignment() -> None:
    buf = host_buffer(10 * ALIGN)
    assert buf.data_ptr() % ALIGN == 0 and buf.numel() == 10 * ALIGN
    parts = split(buf, [ALIGN, 3 * ALIGN, 2 * ALIGN])
    assert [p.numel() for p in parts] == [ALIGN, 3 * ALIGN, 2 * ALIGN]
    assert all(p.data_ptr() % ALIGN == 0 for p in parts)


def test_ram_tier_is_one_region() -> None:
    tier = RamTier({0: ALIGN, 3: 2 * ALIGN, 7: ALIGN}, pin=False)
    assert tier.region.numel() == 4 * ALIGN and tier.nbytes == 4 * ALIGN
    ptrs = sorted(b.data_ptr() for b in tier.buffers.values())
    assert ptrs[0] == tier.region.data_ptr() and ptrs[-1] == tier.region.data_ptr() + 3 * ALIGN


def test_without_cuda_host_register_the_ram_tier_is_pinned_by_torch_in_few_blocks(
        monkeypatch: pytest.MonkeyPatch, layers) -> None:
    """cudaHostRegister unavailable: torch's pinned allocator (faked here: no CUDA) holds the RAM tier in blocks
    it rounds up little (one per pin_groups group), a PinFallbackWarning says so, and the bytes round-trip."""
    blocks: list[int] = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: SimpleNamespace())          # no cudaHostRegister
    monkeypatch.setattr(tiers, "_pin_memory", lambda n: blocks.append(n) or tiers._aligned(n))
    monkeypatch.setattr(tiers, "_WARNED", set())
    sizes = {i: 5 * ALIGN for i in range(40)}                 # 200 pages: one block would reserve 256
    with pytest.warns(tiers.PinFallbackWarning, match="cudaHostRegister is unavailable"):
        tier = RamTier(sizes, pin=True)
    assert sum(blocks) == tier.nbytes == 200 * ALIGN and len(blocks) == len(tier.regions) > 1
    assert tiers.pinned_reserve([[b] for b in blocks]) <= 1.1 * tier.nbytes < tiers.pinned_reserve([blocks])
    assert all(tier.buffers[i].numel() == 5 * ALIGN for i in sizes)
    fill(tier.buffers, MemoryReader([layers[i % len(layers)][:ALIGN].repeat(5) for i in sizes]))
    assert all(torch.equal(tier.buffers[i][:ALIGN], layers[i % len(layers)][:ALIGN]) for i in sizes)
    with pytest.raises(ValueError, match="pinned regions, not one"):
        tier.region
    bounce = host_buffer(3 * ALIGN, pin=True)                 # a single buffer: one block of its size
    assert bounce.numel() == 3 * ALIGN and blocks[-1] == 3 * ALIGN


class FakeCudart:
    """cudaHostRegister / cudaHostUnregister on the CPU: which host ranges are page-locked now."""

    def __init__(self) -> None:
        self.locked: dict[int, int] = {}
        self.registered = self.unregistered = 0

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.locked[ptr] = nbytes
        self.registered += 1
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered += 1
        return 0 if self.locked.pop(ptr, None) is not None else 712      # cudaErrorHostMemoryNotRegistered


def test_a_registered_region_is_unregistered_when_its_last_view_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned host memory stays locked while any view of it lives and is unlocked (before it is freed) as soon as
    the last one goes, by reference counting (no collector pass): a RAM tier dropped with its model, and KV rows
    regrown every 256 slots, leave no locked RAM behind (before, every region stayed registered until the process
    ended)."""
    from specexec.kv.rows import Rows

    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buf = host_buffer(3 * ALIGN + 5, pin=True)
    assert buf.numel() == 3 * ALIGN + 5 and buf.data_ptr() % ALIGN == 0 and len(cudart.locked) == 1
    view = buf[ALIGN:].view(torch.int8)
    del buf
    assert len(cudart.locked) == 1                       # a view keeps it alive and locked
    del view
    assert cudart.locked == {} and cudart.unregistered == 1
    tier = RamTier({0: ALIGN, 1: 2 * ALIGN}, pin=True)
    assert len(cudart.locked) == 1
    del tier
    assert cudart.locked == {}
    alloc = lambda n: host_buffer(n, pin=True)           # noqa: E731 -- how StreamedKV allocates its host rows
    rows = Rows.empty(2, 256, 1, 2, 16, torch.bfloat16, "none", "cpu", alloc)
    for k in range(2, 12):                               # a long chat: the rows regrow by 256 slots ten times
        rows = rows.grown(256 * k, 256 * (k - 1), alloc)
        assert sum(cudart.locked.values()) <= rows.nbytes + 2 * ALIGN, (k, cudart.locked)
    assert cudart.registered == 13 and cudart.unregistered == 12


def test_discard_and_close_wait_for_the_copies_already_queued(layers) -> None:
    """After discard() (or close()) the caller may free what the loaders copied from (a companion's host rows:
    freeing unregisters them) or into: the latest fill's copy-end event is waited for, once, if still pending."""
    class Pending:
        def __init__(self) -> None:
            self.waits = 0

        def query(self) -> bool:
            return self.waits > 0

        def synchronize(self) -> None:
            self.waits += 1
    with build_pager(["ram"] * 3, MemoryReader(layers[:3]), "cpu", n_slots=2) as pager:
        pager.last_copy = ev = Pending()                  # as the copier leaves it on CUDA
        pager.discard()
        pager.discard()
        assert ev.waits == 1
        pager.last_copy = ev = Pending()
    assert ev.waits == 1                                  # close() too


def test_pin_groups_reserve_little() -> None:
    for sizes in ([3 * ALIGN] * 10, [5 * ALIGN] * 40, [7 * ALIGN, ALIGN], [ALIGN] * 1000, [ALIGN * 9] * 81):
        groups = tiers.pin_groups(sizes)
        assert [n for g in groups for n in g] == sizes
        assert tiers.pinned_reserve(groups) <= min(1.1 * sum(sizes), tiers.pinned_reserve([sizes]))


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_a_pager_over_a_layer_cache_serves_exact_bytes(tmp_path: Path, layers, staged: bool,
                                                       posix_facilities: str) -> None:
    """The SSD tier read from a layer cache on disk (the runtime's reader), with and without the POSIX-only
    facilities: the same bytes in order, and the probe reads through it."""
    cache = write_packed(tmp_path / "cache", [(b, LayerLayout((), b.numel())) for b in layers], {"format": "none"})
    if posix_facilities == "fallback":
        assert not cache.direct_io                        # buffered reads, the page cache dropped where it can be
    with build_pager(MIXES["mixed"], cache, "cpu", n_slots=2, staged=staged) as pager:
        for _ in range(3):
            check_pass(pager, layers)
            pager.prefetch_start()
        check_pass(pager, layers, [5, 3, 2])
    assert probe_read(cache, range(len(SIZES)), host_buffer(max(SIZES))) > 0
    cache.close()


def test_probe_copy(layers) -> None:
    dst = host_buffer(max(SIZES))
    assert probe_copy(layers, dst) > 0
    assert torch.equal(dst[:SIZES[-1]], layers[-1])


# ------------------------------------------------------------------------------------------------ CUDA

@pytest.mark.gpu
@pytest.mark.parametrize("mix", list(MIXES))
def test_cuda_pager_serves_exact_bytes(layers, mix: str) -> None:
    with build_pager(MIXES[mix], MemoryReader(layers), "cuda", n_slots=2, n_bounce=2) as pager:
        if pager.ram is not None:
            assert pager.ram.region.is_pinned()
        assert pager.staged == ("ssd" in MIXES[mix]) and all(b.buf.is_pinned() for b in pager.bounce)
        for _ in range(3):
            for i, buf in pager.layers():
                assert buf.is_cuda and torch.equal(buf.cpu(), layers[i])
            pager.prefetch_start()
        s = pager.collect(wait=True)
        assert s.passes == s.folded == 3 and s.compute_s > 0 and s.pass_s > 0


@pytest.mark.gpu
def test_cuda_pinning_falls_back_when_registration_fails(monkeypatch: pytest.MonkeyPatch, layers) -> None:
    """cudaHostRegister refusing (here: a region registered twice) leaves CUDA's last error set; the fallback
    drains it (else torch's next kernel-launch check would raise it) and pins through torch's allocator."""
    first = host_buffer(4 * ALIGN, pin=True)                  # registered
    monkeypatch.setattr(tiers, "_lockable", lambda n: (first, None))   # the next registration: the same memory
    monkeypatch.setattr(tiers, "_WARNED", set())
    with pytest.warns(tiers.PinFallbackWarning, match="failed"):
        buf = host_buffer(4 * ALIGN, pin=True)
    assert buf.data_ptr() != first.data_ptr() and buf.is_pinned()
    assert torch.ones(8, device="cuda").add_(1).sum().item() == 16      # no stale error raised here
    buf[:ALIGN].copy_(layers[3][:ALIGN])
    assert torch.equal(buf[:ALIGN].to("cuda", non_blocking=True).cpu(), layers[3][:ALIGN])


def _matmul_seconds(a: torch.Tensor, reps: int = 20) -> float:
    """GPU seconds of one a @ a (CUDA events, after a warm-up)."""
    a @ a
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ a
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / reps


@pytest.mark.gpu
def test_cuda_copies_overlap_compute() -> None:
    """Big RAM-tier layers, and per layer a matmul load sized on THIS GPU so its compute takes about as long as
    the layer's copy (both measured first): a pass takes well under copy + compute time. Serial, a pass is the
    sum; overlapped, about (n + 1) / 2n of it when the two are equal (0.56 for 8 layers), under 0.72 while
    either is up to twice the other. A fixed load (the old test) made compute dwarf the copies on a fast GPU,
    where no overlap can bring the pass under 0.9 of the sum."""
    n, size = 8, 64 * 2**20
    bufs = [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(2)]
    reader = MemoryReader([bufs[i % 2] for i in range(n)])
    with build_pager(["ram"] * n, reader, "cuda", n_slots=2) as pager:
        for _ in range(2):                                          # warm-up; the second pass times the copies
            before = pager.collect(wait=True).totals()
            for _ in pager.layers():
                pass
        copy_s = (pager.collect(wait=True).totals()["ram_copy_s"] - before["ram_copy_s"]) / n
        dim = 4096
        while True:                                                 # a matmul of at most half a layer's copy
            a = torch.randn(dim, dim, device="cuda")
            mm = _matmul_seconds(a)
            if mm <= copy_s / 2 or dim <= 256:
                break
            dim //= 2
        reps = max(1, round(copy_s / mm))
        before = pager.collect(wait=True).totals()
        for _, buf in pager.layers():
            for _ in range(reps):
                a @ a
            buf[:16].sum()
        after = pager.collect(wait=True).totals()
    d = {k: after[k] - before[k] for k in after}
    copy, compute = d["ram_copy_s"], d["compute_s"]
    assert 0.5 <= compute / copy <= 2, (reps, d)                   # the balance the bound assumes
    assert d["pass_s"] < 0.8 * (copy + compute), (reps, d)


def pinned_gbps(srcs: list[torch.Tensor], dst: torch.Tensor) -> float:
    """GB/s of back-to-back pinned host -> device copies on one stream, timed by CUDA events."""
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for src in srcs:
            dst[:src.numel()].copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return sum(s.numel() for s in srcs) / (start.elapsed_time(end) / 1000) / 1e9


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["8b", "70b"])
@pytest.mark.parametrize("fmt", ["none", "nf4"])
def test_cuda_streamed_pass_runs_at_the_pinned_link_rate(arch: str, fmt: str) -> None:
    """Real layer sizes (Llama-3 8B/70B, bf16 and NF4) streamed from pinned RAM: the pass's GPU time is within
    1.15x of bytes / the link's measured pinned bandwidth, the one copy stream is busy >= 90 % of the pass, and
    copy spans never overlap."""
    from cli.bench.components.stream import layer_layout, synthetic_args

    size = layer_layout(synthetic_args(arch, 1), fmt, torch.bfloat16).nbytes
    n = 12
    ram = RamTier({0: size, 1: size}, pin=True)                     # two distinct pinned layers, aliased
    base = [ram.buffers[0], ram.buffers[1]]
    ram.buffers = {i: base[i % 2] for i in range(n)}
    with LayerPager([size] * n, "cuda", ram=ram, n_slots=2) as pager:
        for _ in pager.layers():                                   # warm-up: threads, events, allocator
            pass
        before = pager.collect(wait=True).totals()
        for _, buf in pager.layers():
            buf[-1:].clone()                                       # compute touches the slot (tiny)
        timing = pager.last_pass
        timing.synchronize()
        after = pager.collect(wait=True).totals()
        bw = pinned_gbps([base[i % 2] for i in range(n)], pager.slots[0].buf)
    d = {k: after[k] - before[k] for k in after}
    ideal = d["bytes_streamed"] / (bw * 1e9)
    assert d["bytes_streamed"] == n * size and d["passes"] == 1
    assert d["pass_s"] <= 1.15 * ideal, (arch, fmt, size, d, bw)
    assert d["busy_s"] >= 0.9 * d["pass_s"], (d, bw)
    copies = [(timing.start.elapsed_time(lt.copy_start), timing.start.elapsed_time(lt.copy_end))
              for lt in timing.layers]
    assert all(e0 <= s1 + 1e-3 for (_, e0), (s1, _) in zip(copies, copies[1:])), copies     # one stream: no overlap


# ------------------------------------------------------------------------------------------------ bench stream

@pytest.mark.parametrize("offload", ["ssd", "ram"])
def test_bench_stream_json_rows(capsys, tmp_path: Path, offload: str) -> None:
    from cli.main import main

    argv = ["bench", "stream", "--synthetic", "1b", "--layers", "2", "--distinct", "1", "--tokens", "1,4",
            "--offload", offload, "--device", "cpu", "--dir", str(tmp_path), "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["arch"] == "1b" and out["quant"] == "nf4" and out["plan"][f"{offload}_layers"] == 2
    assert [r["tokens"] for r in out["rows"]] == [1, 4]
    for r in out["rows"]:
        assert r["tier"] == offload and r["seconds_per_pass"] > 0 and 0 <= r["stall_fraction"] <= 1
        assert r["bytes_per_pass"] == 2 * out["layer_bytes"]
        assert r["effective_gbps"] == pytest.approx(r["bytes_per_pass"] / r["seconds_per_pass"] / 1e9, rel=0.01,
                                                    abs=1e-3)     # rounded to 3 decimals (a slow machine: 0.03)
        assert r["tier_peak_gbps"] > 0
    assert f"{offload.upper() if offload == 'ssd' else 'RAM'} tier" in captured.err
    assert list(tmp_path.iterdir()) == []                          # the SSD file is removed afterwards


def test_bench_stream_streams_with_the_planned_read_ahead(tmp_path: Path) -> None:
    """The planner deepens the SSD read-ahead into the RAM left over (slots on a CPU); the bench's pager must
    stream with that depth, as a real run's does (it used the minimum, 2, whatever the plan said)."""
    import argparse

    from cli.bench.components.stream import StreamBench, layer_layout, make_plan, synthetic_args

    args = synthetic_args("1b", 6)
    size = layer_layout(args, "int4", torch.float32).nbytes
    ns = argparse.Namespace(gpu_budget=None, ram_budget="4GB", quant="int4", offload="ssd")
    the_plan = make_plan(ns, args, size, torch.device("cpu"), torch.float32, 4)
    assert the_plan.n_slots > 2                              # deepened: the budget holds more than the minimum
    bench = StreamBench(args, the_plan, "int4", torch.device("cpu"), torch.float32, 1, str(tmp_path))
    try:
        assert len(bench.model.pager.slots) == the_plan.n_slots and bench.model.pager.depth == the_plan.read_ahead
    finally:
        bench.close()


def test_bench_stream_rejects_bad_flags(capsys) -> None:
    from cli.main import main

    assert main(["bench", "stream", "--synthetic", "1b", "--tokens", "0"]) == 2
    assert "--tokens" in capsys.readouterr().err
    assert main(["bench", "stream", "--synthetic", "3b"]) == 2
    assert main(["bench", "stream", "--synthetic", "1b", "--ram-budget", "1MB", "--device", "cpu"]) == 2
    assert "error: --ram-budget" in capsys.readouterr().err


class PartReader(MemoryReader):
    """A MemoryReader that also reads parts (offset, out.numel()) and logs them."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        super().__init__(buffers)
        self.parts: list[tuple[int, int, int]] = []

    def read_part(self, i: int, offset: int, out: torch.Tensor) -> None:
        out.copy_(self.buffers[i][offset:offset + out.numel()])
        self.parts.append((i, offset, out.numel()))


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("mix", ["ram", "ssd", "mixed"])
def test_layers_in_parts_move_their_heads_then_what_the_consumer_asks(layers, mix: str, staged: bool) -> None:
    """With heads, the read-ahead moves only each layer's head; fill_ranges brings the asked ranges of the layer
    the consumer holds to their offsets in the slot (the rest stays unread); every byte moved is counted."""
    tiers = MIXES[mix]
    heads = [ALIGN] * len(SIZES)
    reader = PartReader(layers)
    with build_pager(tiers, reader, "cpu", n_slots=2, staged=staged, heads=heads) as pager:
        for _ in range(2):
            for i, buf in pager.layers():
                assert torch.equal(buf[:ALIGN], layers[i][:ALIGN])
                if SIZES[i] > 2 * ALIGN and tiers[i] != "resident":
                    slot = next(k for k, s in enumerate(pager.slots) if s.buf.data_ptr() == buf.data_ptr())
                    rng = [(2 * ALIGN, ALIGN)]
                    assert pager.fill_ranges(i, slot, rng) == ALIGN
                    assert torch.equal(buf[2 * ALIGN:3 * ALIGN], layers[i][2 * ALIGN:3 * ALIGN])
        asked = {t: sum(ALIGN for i, ti in enumerate(tiers) if ti == t and SIZES[i] > 2 * ALIGN) for t in ("ram", "ssd")}
        heads_moved = {t: sum(ALIGN for ti in tiers if ti == t) for t in ("ram", "ssd")}
        assert pager.stats.bytes == {t: 2 * (heads_moved[t] + asked[t]) for t in ("ram", "ssd")}
    ssd_parts = [p for p in reader.parts if p[1] != 0]
    assert all(n == ALIGN for _, _, n in reader.parts) and len(ssd_parts) == 2 * sum(
        1 for i, t in enumerate(tiers) if t == "ssd" and SIZES[i] > 2 * ALIGN)


def test_heads_must_fit_their_layers(layers) -> None:
    with pytest.raises(ValueError, match="multiples of"):
        build_pager(["ssd"] * 6, PartReader(layers), "cpu", heads=[ALIGN + 1] * 6)
    with pytest.raises(ValueError, match="at most its"):
        build_pager(["ssd"] * 6, PartReader(layers), "cpu", heads=[2 * ALIGN] * 6)          # layer 3 is 1 page


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("n_slots", [1, 2, 3])
@pytest.mark.parametrize("mix", ["ssd", "mixed"])
def test_a_held_layer_keeps_its_bytes_while_the_loaders_read_ahead(layers, mix: str, n_slots: int,
                                                                     staged: bool) -> None:
    """The view a pass holds is never refilled under it: with the loaders as far ahead as they can get (every
    other slot and bounce buffer full: wait_idle) and the consumer's own fills of more of the layer, the held
    layer's bytes are still its own, until the pass moves on."""
    tiers = MIXES[mix]
    with build_pager(tiers, PartReader(layers), "cpu", n_slots=n_slots, staged=staged,
                     heads=[ALIGN] * len(SIZES)) as pager:
        for _ in range(2):
            for i, buf in pager.layers():
                if tiers[i] != "resident":
                    slot = next(k for k, s in enumerate(pager.slots) if s.buf.data_ptr() == buf.data_ptr())
                    assert pager.wait_idle(10)
                    pager.fill_ranges(i, slot, [(ALIGN, SIZES[i] - ALIGN)])
                assert pager.wait_idle(10)
                assert torch.equal(buf, layers[i]), f"layer {i}"
            pager.prefetch_start()
