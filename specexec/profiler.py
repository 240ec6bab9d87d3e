"""Profiler: named spans, counters and per-step records of one generation; a table for people and one JSON
line for scripts.

A span times one region: on CUDA with a pair of CUDA events recorded on the current stream (no host sync is
added; the elapsed time is read once the end event has completed, `Span.ready`, or when someone outside the
step path asks for `seconds`, which waits for that one event), on the CPU with time.perf_counter. Steps
recorded with spans keep their times pending until the spans are ready (`settle()`; `steps` waits for the
rest), so recording a step never waits for the device; `on_timed` callbacks (the budget tuner) hear the times
in step order as they settle. Counters add up
numbers (prompt tokens, generated tokens). Sources are callables that return cumulative counters (an offload
pager's bytes streamed, copy and stall seconds); every step records how much they grew during that step, so
the pager only has to keep running totals. `begin()` starts a new generation: spans, counters and steps are
cleared and the clock for time-to-first-token starts. For a mixture-of-experts target the engine counts, per
verification pass, its distinct experts per sparse layer and what the target's experts cost it (moe_* counters,
specexec/companions/experts.py); `moe_stats` turns them into stats.moe (means over passes). `note()` keeps one-line
events for people (the gate's switches, specexec/companions/gate.py); with the gate_* counters they make stats.gate.

Also here: `PeakMemory`, which samples the process RSS on a thread and reads torch's CUDA peak, for benchmarks.

Does not know: models, trees or the decoding loop (the engine says what a step was), where streamed bytes come
from (a source reports them), terminals (`table()` returns a rich renderable for the caller to print).
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from collections import deque
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

Source = Callable[[], Mapping[str, float]]
OnTimed = Callable[[float, float], None]                   # (draft seconds, target seconds) of one step
STREAM_KEYS = ("bytes_streamed", "copy_s", "stall_s")     # the cumulative counters a stream source reports
PLAIN_STEPS, SPECULATIVE_STEPS, SWITCHES = "gate_plain_steps", "gate_speculative_steps", "gate_switches"  # the gate's


class Span:
    """One timed region. Created by Profiler.start(); stop() ends it; seconds reads the elapsed time."""

    __slots__ = ("name", "_events", "_t0", "_t1")

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self._events: tuple[Any, Any] | None = None
        self._t1: float | None = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._t0 = time.perf_counter()

    def stop(self) -> "Span":
        if self._events is not None:
            self._events[1].record()
        self._t1 = time.perf_counter()
        return self

    @property
    def done(self) -> bool:
        return self._t1 is not None

    @property
    def ready(self) -> bool:
        """Stopped, and (CUDA) its end event has completed: `seconds` will not wait."""
        return self._t1 is not None and (self._events is None or self._events[1].query())

    @property
    def seconds(self) -> float:
        """Elapsed seconds (CUDA: GPU time between the two events, waiting for the second one unless ready)."""
        if self._t1 is None:
            raise RuntimeError(f"span {self.name!r} was not stopped")
        if self._events is None:
            return self._t1 - self._t0
        if not self._events[1].query():
            self._events[1].synchronize()              # this event only; callers outside the step path
        return self._events[0].elapsed_time(self._events[1]) / 1000.0

    def __enter__(self) -> "Span":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._t1 is None:
            self.stop()


@dataclass(frozen=True)
class StepStat:
    """One decoding step: the tree the target verified and what it cost."""

    tree_size: int           # non-root nodes the target verified
    depth: int
    accepted: int            # tokens the step produced (accepted path + bonus), before stop/limit trimming
    draft_ms: float
    target_ms: float
    bytes_streamed: int | None = None    # weight bytes a stream source moved during the step (offloaded target)
    stall_ms: float | None = None        # compute waiting for weights during the step
    budget: int | None = None            # the tree budget the step asked for (--budget auto: the tuner's pick)


class Profiler:
    """Spans, counters and steps of the current generation (since begin())."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._sources: list[Source] = []
        self.gauges: dict[str, float] = {}      # values that are not summed (e.g. the link's measured peak GB/s)
        self.begin()

    def begin(self) -> None:
        """Start a new generation: clear spans, counters and steps; restart the clock."""
        self.spans: list[Span] = []
        self.counters: dict[str, float] = {}
        self.notes: list[str] = []              # one-line events of this generation (the gate's switches)
        self._steps: list[StepStat] = []
        self._pending: deque[tuple[int, Span | float, Span | float, OnTimed | None]] = deque()
        self._kept = 0                          # spans before this index belong to finished work (keep())
        self._t0 = time.perf_counter()
        self._first: float | None = None
        self._last: float | None = None
        self._base = self._poll()
        self._step_base = dict(self._base)

    # ------------------------------------------------------------------ feeding
    def start(self, name: str) -> Span:
        """A running span named `name`; call .stop() on it (or use it as a context manager)."""
        span = Span(name, self.device)
        self.spans.append(span)
        return span

    def span(self, name: str) -> Span:
        """Context-manager form: `with profiler.span("draft"): ...`."""
        return self.start(name)

    def keep(self) -> None:
        """Every span so far belongs to finished work (a prefill done; step() marks its own)."""
        self._kept = len(self.spans)

    def abandon(self) -> None:
        """A step cut short (Ctrl-C, an error): its spans go, so every figure counts the same steps: a phase's
        calls, the steps and the total time (which ends at the last step's tokens)."""
        del self.spans[self._kept:]

    def count(self, **values: float) -> None:
        """Add to named counters: count(prompt_tokens=12, generated=3)."""
        for name, value in values.items():
            self.counters[name] = self.counters.get(name, 0) + value

    def note(self, text: str) -> None:
        """Keep a one-line event of this generation for people (chat and bench print them)."""
        self.notes.append(text)

    def watch(self, source: Source) -> None:
        """Register a callable returning cumulative counters (see STREAM_KEYS); polled at each step."""
        self._sources.append(source)
        for k, v in source().items():
            self._base[k] = self._base.get(k, 0) + float(v)
            self._step_base[k] = self._step_base.get(k, 0) + float(v)

    def first_token(self) -> None:
        """Mark the moment the first new token is ready (the engine's first step does this itself)."""
        now = time.perf_counter()
        if self._first is None:
            self._first = now
        self._last = now

    def step(self, tree_size: int, depth: int, accepted: int, draft_s: Span | float, target_s: Span | float,
             budget: int | None = None, on_timed: OnTimed | None = None) -> StepStat | None:
        """Record one decoding step; stream sources' growth since the previous step is attributed to it.
        draft_s/target_s: seconds, or the stopped spans that timed them (CUDA: their times settle once the
        events completed, never by waiting here). on_timed(draft_s, target_s) is called when they settle.
        Returns the record when its times are known now, else None (read `steps` later)."""
        self.first_token()
        now = self._poll()
        delta = {k: v - self._step_base.get(k, 0) for k, v in now.items()}
        self._step_base = now
        stall = delta.get("stall_s")
        self._steps.append(StepStat(tree_size, depth, accepted, 0.0, 0.0,
                                    int(delta["bytes_streamed"]) if "bytes_streamed" in delta else None,
                                    1000 * stall if stall is not None else None, budget))
        self._pending.append((len(self._steps) - 1, draft_s, target_s, on_timed))
        self.keep()
        self.settle()
        index = len(self._steps) - 1
        return None if self._pending and self._pending[-1][0] == index else self._steps[index]

    def settle(self, wait: bool = False) -> None:
        """Fill in the times of pending steps whose spans are ready, in step order (wait=True: all of them,
        waiting for their end events; outside the step path only)."""
        while self._pending:
            index, draft, target, on_timed = self._pending[0]
            if not wait and not (_ready(draft) and _ready(target)):
                return
            self._pending.popleft()
            d, t = _seconds(draft), _seconds(target)
            self._steps[index] = replace(self._steps[index], draft_ms=1000 * d, target_ms=1000 * t)
            if on_timed is not None:
                on_timed(d, t)

    @property
    def steps(self) -> list[StepStat]:
        """Every step of this generation with its times (waits for pending ones: not on the step path)."""
        self.settle(wait=True)
        return self._steps

    def _poll(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for source in self._sources:
            for k, v in source().items():
                out[k] = out.get(k, 0) + float(v)
        return out

    # ------------------------------------------------------------------ reading
    @property
    def ttft_s(self) -> float | None:
        """Seconds from begin() to the first token (None before the first step)."""
        return None if self._first is None else self._first - self._t0

    @property
    def wall_s(self) -> float:
        """Seconds from begin() to the last token (or to now, before any)."""
        return (self._last if self._last is not None else time.perf_counter()) - self._t0

    def totals(self) -> dict[str, dict[str, float]]:
        """Span name -> {"calls", "ms"} over the finished spans of this generation."""
        out: dict[str, dict[str, float]] = {}
        for span in self.spans:
            if span.done:
                t = out.setdefault(span.name, {"calls": 0, "ms": 0.0})
                t["calls"] += 1
                t["ms"] += 1000 * span.seconds
        return {k: {"calls": v["calls"], "ms": round(v["ms"], 3)} for k, v in out.items()}

    def streamed(self) -> dict[str, float]:
        """Growth of the stream sources since begin() (empty without sources)."""
        now = self._poll()
        return {k: v - self._base.get(k, 0) for k, v in now.items()}

    def summary(self) -> dict[str, Any]:
        """Everything about this generation as plain numbers (see summarize())."""
        return summarize(self.totals(), self.counters, self.steps, self.streamed(), self.gauges,
                         self.ttft_s, self.wall_s, self.notes)

    def json_line(self, steps: bool = False) -> str:
        """summary() as one compact JSON line; steps=True adds the per-step records."""
        obj = self.summary()
        if steps:
            obj["step_records"] = [asdict(s) for s in self.steps]
        return json.dumps(obj, separators=(",", ":"))

    def table(self, title: str = "profile"):
        """A rich Table of the phases (prefill, draft, target, streaming) for people."""
        return summary_table(self.summary(), title)


def _ready(x: Span | float) -> bool:
    return not isinstance(x, Span) or x.ready


def _seconds(x: Span | float) -> float:
    return x.seconds if isinstance(x, Span) else float(x)


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def _per(total: float, n: float) -> float | None:
    return total / n if n else None


def summarize(totals: Mapping[str, Mapping[str, float]], counters: Mapping[str, float], steps: list[StepStat],
              streamed: Mapping[str, float], gauges: Mapping[str, float], ttft_s: float | None,
              wall_s: float, notes: Iterable[str] = ()) -> dict[str, Any]:
    """The profile as one flat dict: token counts, rates, per-step averages, streaming totals and spans.
    decode_s is the wall time after prefill (what a user waits for once the prompt is in); streamed_gb counts
    the prefill too, effective_gb_s only the steps' bytes over the steps' target time."""
    n = len(steps)
    prefill_s = totals.get("prefill", {}).get("ms", 0.0) / 1000
    generated = int(counters.get("generated", sum(s.accepted for s in steps)))
    prompt = int(counters.get("prompt_tokens", 0))
    decode_s = max(wall_s - prefill_s, 0.0) if n else 0.0
    target_s = sum(s.target_ms for s in steps) / 1000
    nbytes = streamed.get("bytes_streamed")
    per_step = [s.bytes_streamed for s in steps if s.bytes_streamed is not None]
    step_bytes = sum(per_step) if per_step else None      # the verification passes' bytes (prefill excluded)
    return {
        "prompt_tokens": prompt, "reused_tokens": int(counters.get("reused_tokens", 0)),
        "generated": generated, "steps": n, "tokens_per_step": _r(_per(generated, n)),
        "prefill_s": _r(prefill_s, 4), "prefill_tok_s": _r(_per(prompt, prefill_s), 2),
        "decode_s": _r(decode_s, 4), "decode_tok_s": _r(_per(generated, decode_s), 2),
        "ttft_s": _r(ttft_s, 4), "wall_s": _r(wall_s, 4),
        "draft_ms": _r(_per(sum(s.draft_ms for s in steps), n), 3),
        "target_ms": _r(_per(sum(s.target_ms for s in steps), n), 3),
        "tree_size": _r(_per(sum(s.tree_size for s in steps), n), 1),
        "budget": _r(_per(sum(s.budget for s in steps if s.budget is not None),
                          sum(s.budget is not None for s in steps)), 1),
        "budget_trace": budget_trace(s.budget for s in steps),
        "depth": _r(_per(sum(s.depth for s in steps), n), 2),
        "bytes_streamed": int(nbytes) if nbytes is not None else None,
        "streamed_gb": _r(nbytes / 1e9, 6) if nbytes is not None else None,
        "effective_gb_s": _r(_per(step_bytes / 1e9, target_s), 3) if step_bytes is not None else None,
        "link_peak_gb_s": _r(gauges.get("link_peak_gb_s"), 3),
        "stall_ms": _r(1000 * streamed["stall_s"], 2) if "stall_s" in streamed else None,
        "spans": dict(totals),
        "counters": {k: v for k, v in counters.items()},
        "moe": moe_stats(counters, gauges),
        "gate": gate_stats(counters, notes),
    }


def moe_stats(counters: Mapping[str, float], gauges: Mapping[str, float]) -> dict | None:
    """stats.moe from the profiler's counters (means over passes): distinct_experts_per_layer,
    expert_bytes_per_pass, draft_expert_bytes_per_pass (experts a self-draft read into its hot copies: 0 for
    any other draft), expert_bytes_all, expert_cache_hit_rate (None without lookups), cpu_expert_rows_per_pass
    (rows x layers whose experts ran on the CPU: --experts cpu), cpu_expert_bytes_crossed_per_pass (hidden states
    and routing they moved across the link, 0 on a CPU); None when no MoE pass was counted."""
    n = counters.get("moe_passes", 0.0)
    if not n:
        return None
    lookups = counters.get("moe_expert_lookups", 0.0)
    return {"distinct_experts_per_layer": round(counters.get("moe_distinct", 0.0) / n, 3),
            "expert_bytes_per_pass": round(counters.get("moe_expert_bytes", 0.0) / n, 1),
            "draft_expert_bytes_per_pass": round(counters.get("moe_draft_expert_bytes", 0.0) / n, 1),
            "expert_bytes_all": int(gauges.get("moe_expert_bytes_all", 0)),
            "expert_cache_hit_rate": round(counters.get("moe_expert_hits", 0.0) / lookups, 4) if lookups else None,
            "cpu_expert_rows_per_pass": round(counters.get("moe_cpu_expert_rows", 0.0) / n, 2),
            "cpu_expert_bytes_crossed_per_pass": round(counters.get("moe_cpu_expert_bytes_crossed", 0.0) / n, 1),
            "passes": int(n)}


def budget_trace(budgets: Iterable[int | None], limit: int = 12) -> str | None:
    """The budget each step asked for (None: a step without a tree), run-length encoded in step order:
    "64×3 128×2 256×10" (the last `limit` runs, "…" before them when cut); None when no step had a tree."""
    runs: list[list[int]] = []
    for b in budgets:
        if b is None:
            continue
        if runs and runs[-1][0] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    if not runs:
        return None
    text = " ".join(f"{b}×{k}" if k > 1 else str(b) for b, k in runs[-limit:])
    return ("… " if len(runs) > limit else "") + text


def _fmt(x: float | None, unit: str = "", nd: int = 1) -> str:
    return "–" if x is None else f"{x:,.{nd}f}{unit}"


def summary_table(s: Mapping[str, Any], title: str = "profile"):
    """A rich Table of one summary(): one row per phase, then the end-to-end rates."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for col in ("phase", "calls", "total ms", "ms/call", "notes"):
        table.add_column(col, justify="left" if col in ("phase", "notes") else "right")
    spans = s.get("spans", {})
    notes = {
        "prefill": f"{s['prompt_tokens']} tokens prefilled, {s['reused_tokens']} reused · "
                   f"{_fmt(s['prefill_tok_s'], ' tok/s')}",
        "draft": f"tree {_fmt(s['tree_size'])} nodes, depth {_fmt(s['depth'])}"
                 + (f" · budget per step {s['budget_trace']}" if s.get("budget_trace") else ""),
        "target": f"{_fmt(s['tokens_per_step'], ' tokens/pass', 2)}",
    }
    for name, t in spans.items():
        table.add_row(name, str(int(t["calls"])), _fmt(t["ms"]), _fmt(_per(t["ms"], t["calls"]), nd=2),
                      notes.get(name, ""))
    if s.get("streamed_gb") is not None:
        peak = f" of {_fmt(s['link_peak_gb_s'], ' GB/s', 2)} peak" if s.get("link_peak_gb_s") else ""
        table.add_row("stream", "", "", "", f"{_fmt(s['streamed_gb'], ' GB', 2)} · "
                      f"{_fmt(s['effective_gb_s'], ' GB/s', 2)} effective{peak} · stalls {_fmt(s['stall_ms'], ' ms')}")
    moe = s.get("moe")
    if moe:
        hit = moe["expert_cache_hit_rate"]
        table.add_row("experts", str(moe["passes"]), "", "", f"{moe['distinct_experts_per_layer']:.1f} distinct per "
                      f"sparse layer · {moe['expert_bytes_per_pass'] / 1e6:.2f} of {moe['expert_bytes_all'] / 1e6:.2f}"
                      f" MB read per pass" + (f" · cache hits {100 * hit:.0f} %" if hit is not None else ""))
    table.add_row("total", str(s["steps"]), _fmt(1000 * s["wall_s"]), "",
                  f"{s['generated']} tokens · {_fmt(s['tokens_per_step'], ' tokens/pass', 2)} · "
                  f"decode {_fmt(s['decode_tok_s'], ' tok/s', 2)} · "
                  f"TTFT {_fmt(s['ttft_s'], ' s', 3)}")
    return table


class PeakMemory:
    """Peak process RSS (sampled on a thread every `interval` s) and peak CUDA memory allocated by torch,
    over a `with` block. Read .ram_bytes and .vram_bytes (None without CUDA) after the block."""

    def __init__(self, device: torch.device | str = "cpu", interval: float = 0.01) -> None:
        self.device = torch.device(device)
        self.interval = interval
        self.ram_bytes = 0
        self.vram_bytes: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        import psutil

        proc = psutil.Process()
        while True:
            self.ram_bytes = max(self.ram_bytes, proc.memory_info().rss)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.device.type == "cuda":
            self.vram_bytes = int(torch.cuda.max_memory_allocated(self.device))


def gate_stats(counters: Mapping[str, float], events: Iterable[str]) -> dict | None:
    """stats.gate from the profiler's counters and notes: switches, plain_steps, speculative_steps and the
    switch lines (events); None when no step was gated."""
    plain, spec = counters.get(PLAIN_STEPS, 0), counters.get(SPECULATIVE_STEPS, 0)
    if not plain and not spec:
        return None
    return {"switches": int(counters.get(SWITCHES, 0)), "plain_steps": int(plain), "speculative_steps": int(spec),
            "events": list(events)}
