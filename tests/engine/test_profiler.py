"""specexec.profiler: spans, counters, per-step records with stream sources, the summary table and JSON line,
the engine feeding it, and PeakMemory."""
from __future__ import annotations

import io
import json
import time

import pytest
import torch
from rich.console import Console

from specexec.config import EngineConfig
from specexec.profiler import PeakMemory, Profiler, Span, summary_table
from specexec.runtime.assembly import Runtime


class FakeClock:
    """time.perf_counter for the profiler's host timestamps: it moves only when the test says."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_spans_time_regions_and_sum_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from specexec import profiler

    clock = FakeClock()
    monkeypatch.setattr(profiler, "time", clock)
    prof = Profiler("cpu")
    with prof.span("draft"):
        clock.sleep(0.02)
    span = prof.start("draft")
    clock.sleep(0.01)
    span.stop()
    prof.start("never-stopped")
    clock.sleep(5.0)                                     # time passing after a stop changes nothing
    totals = prof.totals()
    assert set(totals) == {"draft"}                       # unfinished spans are not counted
    assert totals["draft"]["calls"] == 2
    assert totals["draft"]["ms"] == pytest.approx(30.0)
    with pytest.raises(RuntimeError, match="not stopped"):
        Span("x", torch.device("cpu")).seconds


def test_counters_steps_and_stream_sources() -> None:
    prof = Profiler("cpu")
    pager = {"bytes_streamed": 1e9, "stall_s": 0.5, "copy_s": 0.1}     # cumulative, as a pager reports
    prof.watch(lambda: dict(pager))
    prof.begin()
    prof.count(prompt_tokens=7, reused_tokens=3)
    with prof.span("prefill"):
        pass
    pager.update(bytes_streamed=3e9, stall_s=0.6)
    first = prof.step(tree_size=8, depth=3, accepted=4, draft_s=0.002, target_s=0.010)
    pager.update(bytes_streamed=4e9)
    time.sleep(0.01)
    second = prof.step(tree_size=6, depth=2, accepted=2, draft_s=0.001, target_s=0.010)
    prof.count(generated=6)
    assert (first.bytes_streamed, second.bytes_streamed) == (2 * 10**9, 10**9)
    assert first.stall_ms == pytest.approx(100.0) and second.stall_ms == pytest.approx(0.0)
    assert (first.draft_ms, first.target_ms) == (pytest.approx(2.0), pytest.approx(10.0))
    s = prof.summary()
    assert s["prompt_tokens"] == 7 and s["reused_tokens"] == 3 and s["generated"] == 6
    assert s["steps"] == 2 and s["tokens_per_step"] == 3.0 and s["tree_size"] == 7.0 and s["depth"] == 2.5
    assert s["bytes_streamed"] == 3 * 10**9 and s["streamed_gb"] == pytest.approx(3.0)
    assert s["stall_ms"] == pytest.approx(100.0)
    assert s["effective_gb_s"] == pytest.approx(3.0 / 0.020, rel=1e-3)
    assert s["ttft_s"] is not None and s["ttft_s"] <= s["wall_s"]
    assert s["decode_tok_s"] == pytest.approx(6 / s["decode_s"], rel=1e-2)


def test_json_line_and_table() -> None:
    prof = Profiler("cpu")
    prof.watch(lambda: {"bytes_streamed": 0, "stall_s": 0.0})
    prof.begin()
    with prof.span("prefill"):
        pass
    prof.step(4, 2, 3, 0.001, 0.002)
    line = prof.json_line(steps=True)
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["steps"] == 1 and obj["step_records"][0]["tree_size"] == 4 and "prefill" in obj["spans"]
    out = io.StringIO()
    Console(file=out, width=160).print(prof.table("t"))
    text = out.getvalue()
    for needle in ("prefill", "total", "stream", "tokens/pass"):
        assert needle in text, needle


def test_table_without_steps_or_streams() -> None:
    out = io.StringIO()
    Console(file=out, width=160).print(summary_table(Profiler("cpu").summary()))
    assert "total" in out.getvalue() and "stream" not in out.getvalue()


def test_engine_feeds_the_profiler(tiny_pair, tiny_perturbed_draft) -> None:
    rt = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), EngineConfig(budget=8))
    prompt = rt.encode("The quick brown fox")
    ids = [t for step in rt.generate_ids(prompt, 12) for t in step]
    s = rt.engine.profiler.summary()
    stats = rt.engine.stats
    assert s["generated"] == len(ids) == stats.generated
    assert s["steps"] == len(stats.steps)
    assert s["spans"]["draft"]["calls"] == s["spans"]["target"]["calls"] == s["steps"]
    assert s["prompt_tokens"] == len(prompt) - 1 and s["reused_tokens"] == 0
    assert stats.prefill_s * 1000 == pytest.approx(s["spans"]["prefill"]["ms"], abs=1e-3)
    recs = rt.engine.profiler.steps
    assert recs is stats.steps                                # one ledger: the stats read the profiler's records
    assert all(r.bytes_streamed is None for r in recs)        # a resident target streams nothing
    list(rt.generate_ids(prompt, 4))                          # a new call starts a new profile
    assert rt.engine.profiler.summary()["generated"] <= 4


@pytest.mark.parametrize("cut_in", ["draft", "target"])
def test_a_step_cut_by_ctrl_c_is_counted_nowhere(tiny_pair, tiny_perturbed_draft, cut_in) -> None:
    """Ctrl-C in the middle of a step (in its draft or its target pass): every figure of the profile counts the
    same steps: each phase's calls, the steps, and a total time that is not below the phases' sum."""
    rt = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), EngineConfig(budget=8))
    prompt = rt.encode("The quick brown fox")
    model = rt.engine.target if cut_in == "target" else rt.engine.draft
    armed, real = [False], model.forward

    def forward(*args, **kwargs):
        if armed[0]:                                   # the first pass of the third step
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    model.forward = forward
    ids: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        for i, step in enumerate(rt.generate_ids(prompt, 64)):
            ids += step
            armed[0] = i == 1
    s = rt.engine.profiler.summary()
    assert s["steps"] == 2 and s["generated"] == len(ids)
    assert s["spans"]["draft"]["calls"] == s["spans"]["target"]["calls"] == s["steps"]
    phases = sum(t["ms"] for t in s["spans"].values())
    assert 1000 * s["wall_s"] >= phases


def test_peak_memory_sees_an_allocation() -> None:
    with PeakMemory("cpu", interval=0.001) as before:
        time.sleep(0.01)
    with PeakMemory("cpu", interval=0.001) as mem:
        x = torch.ones(64 * 2**20 // 4)                        # 64 MiB, touched
        time.sleep(0.05)
        del x
    assert mem.ram_bytes > 0 and mem.vram_bytes is None
    assert mem.ram_bytes >= before.ram_bytes


@pytest.mark.gpu
def test_cuda_spans_use_events() -> None:
    prof = Profiler("cuda")
    a = torch.randn(2048, 2048, device="cuda")
    with prof.span("matmul") as span:
        for _ in range(10):
            a = a @ a / 2048
    assert span._events is not None and span.seconds > 0


def test_budget_trace_is_run_length_encoded_in_step_order() -> None:
    from specexec.profiler import StepStat, budget_trace

    steps = [StepStat(4, 2, 3, 1.0, 1.0, budget=b) for b in (64, 64, 128, 256, 256, 256, 64)]
    assert budget_trace(s.budget for s in steps) == "64×2 128 256×3 64"
    assert budget_trace([StepStat(0, 0, 1, 0.0, 1.0).budget]) is None     # target-only steps: no tree
    assert budget_trace([64, 64, 128, 256, 256, 256, 64], limit=2).startswith("… 256×3")


def test_steps_timed_by_spans_settle_when_their_events_complete_never_by_waiting() -> None:
    """CUDA spans are events the device completes later: recording a step never waits for them; their times
    (and on_timed, the tuner's feed) arrive in step order once query() says done; `steps` waits if asked."""
    from types import SimpleNamespace

    from tests.offload.lag_event import LagEvent

    clock = SimpleNamespace(done=False, waits=0)
    prof = Profiler("cpu")

    def span(name: str, ms: float) -> Span:
        s = prof.start(name)
        s._events = (LagEvent(clock).record(), LagEvent(clock))
        s.stop()
        s._events[1].t = s._events[0].t + ms / 1000
        return s

    heard: list[tuple[float, float]] = []
    assert prof.step(4, 2, 3, span("draft", 2), span("target", 10), on_timed=lambda d, t: heard.append((d, t))) is None
    assert prof.step(6, 3, 2, 0.001, 0.004, on_timed=lambda d, t: heard.append((d, t))) is None   # behind step 1
    assert heard == [] and clock.waits == 0
    clock.done = True
    prof.settle()
    assert heard == [pytest.approx((0.002, 0.010)), pytest.approx((0.001, 0.004))] and clock.waits == 0
    clock.done = False
    prof.step(2, 1, 1, span("draft", 1), span("target", 3))
    assert [round(s.target_ms, 3) for s in prof.steps] == [10.0, 4.0, 3.0] and clock.waits > 0


@pytest.mark.gpu
def test_cuda_generation_never_synchronizes_the_device(tiny_pair, tiny_perturbed_draft, tmp_path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed target on CUDA: no torch.cuda.synchronize while generating (it would make the next pass's
    prefetch finish before drafting instead of during it); step times still arrive, from CUDA events, and the
    output equals the resident target's."""
    from specexec.config import OffloadConfig

    config = EngineConfig(budget=8, max_new_tokens=16, device="cuda", dtype="float32")
    common = {"quant": "nf4", "cache_dir": str(tmp_path)}
    streamed = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config,
                            offload=OffloadConfig(offload="ssd", **common))
    resident = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config,
                            offload=OffloadConfig(offload="none", **common))
    prompt = streamed.encode("The quick brown fox")
    list(streamed.generate_ids(prompt, 4))                       # warm-up (cost calibration, kernels)
    calls: list[tuple] = []
    real = torch.cuda.synchronize

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "synchronize", counted)
    ids = [t for step in streamed.generate_ids(prompt, 16) for t in step]
    monkeypatch.undo()
    assert calls == []
    steps = streamed.engine.profiler.steps
    assert len(steps) >= 2 and all(s.draft_ms > 0 and s.target_ms > 0 for s in steps)
    stats = streamed.stats()
    assert stats["bytes_streamed"] > 0 and stats["effective_gbps"] > 0 and stats["passes"] >= len(steps)
    assert ids == [t for step in resident.generate_ids(prompt, 16) for t in step]
    streamed.engine.close()
