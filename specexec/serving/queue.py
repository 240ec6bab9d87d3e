"""Generations for a server: a FIFO of Jobs run by `parallel` worker threads (one by default; more share each
target pass: GenerationQueue), events handed to the asyncio loop of the request that submitted them,
cancellation at the next step, and running totals for /metrics.

`GenerationQueue.submit(job)` (on the event loop) returns a Ticket; the worker runs the ticket's job with
`run_job`, which calls Runtime.generate_text once per choice and emits `Delta` (new text of one choice),
`Finished` (its finish reason, token counts and the engine's step statistics) and finally `End` (or `Failed`
when the job raised). `Ticket.cancel()` (a client went away) takes a waiting ticket out of the queue, or stops a
running one before its next step: the engine's generator is closed and the worker moves on. Consecutive jobs
of a worker share its engine, so a prompt that extends its previous one reuses its KV cache (Engine does it by
prefix).

Does not know: HTTP, JSON shapes (specexec.serving.openai_api), how a step works (specexec.runtime.assembly,
specexec.decoding.engine).
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from specexec.batching.pool import SeatPool
from specexec.serving.openai_api import Job
from specexec.runtime.assembly import Runtime
from specexec.serving import logprobs as lp


class QueueFull(RuntimeError):
    """The queue already holds max_queue waiting requests."""


@dataclass(frozen=True)
class Delta:
    index: int
    text: str
    logprobs: tuple[dict, ...] = ()          # its tokens' logprobs entries (serving/logprobs.py), when asked


@dataclass(frozen=True)
class Finished:
    index: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict
    ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(frozen=True)
class End:
    queue_ms: float            # how long the job waited for the worker


Event = Delta | Finished | Failed | End


class Ticket:
    """A submitted job: its events arrive on `events` (an asyncio.Queue of the submitting loop)."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop) -> None:
        self.job, self.loop = job, loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.on_cancel: Callable[[Ticket], None] | None = None
        self.parts = 1                    # parts of the job not yet ended (siblings: one per choice)
        self.started = False              # a part has started (the job's wait is over)
        self.queue_ms = 0.0
        self.outcome = "jobs_completed"
        self._lock = threading.Lock()

    def begin_part(self) -> bool:
        """A part starts; True for the job's first (its wait ends now)."""
        with self._lock:
            first, self.started = not self.started, True
            if first:
                self.queue_ms = 1000 * (time.perf_counter() - self.submitted)
            return first

    def settle(self, outcome: str) -> bool:
        """A part ended as `outcome` (failed wins over cancelled over completed); True when it is the first
        failure (the one reported)."""
        with self._lock:
            first_failure = outcome == "jobs_failed" and self.outcome != "jobs_failed"
            if outcome == "jobs_failed" or (outcome == "jobs_cancelled" and self.outcome == "jobs_completed"):
                self.outcome = outcome
            return first_failure

    def end_parts(self, n: int = 1) -> bool:
        """n parts ended (or left the queue); True when none is left (the job has ended)."""
        with self._lock:
            self.parts -= n
            return self.parts == 0

    def cancel(self) -> None:
        """Stop this job before its next step (or drop it from the queue); harmless once it has ended."""
        if not self.cancelled.is_set():
            self.cancelled.set()
            if self.on_cancel is not None:
                self.on_cancel(self)

    def emit(self, event: Event) -> None:
        """From the worker thread: hand `event` to the submitting loop (a closed loop cancels the job)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            self.cancelled.set()


class Metrics:
    """Running totals over every generation the worker ran (read with snapshot(); thread-safe)."""

    COUNTERS = ("jobs_submitted", "jobs_started", "jobs_completed", "jobs_cancelled", "jobs_failed",
                "generated_tokens", "prefilled_tokens", "reused_tokens", "steps", "decode_seconds", "bytes_streamed",
                "queue_seconds")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals: dict[str, float] = {k: 0 for k in self.COUNTERS}
        self.last: dict[str, Any] = {}

    def add(self, **values: float) -> None:
        with self._lock:
            for k, v in values.items():
                self.totals[k] += v

    def started(self, queue_ms: float) -> None:
        """A job leaves the queue for the worker after waiting queue_ms."""
        with self._lock:
            self.totals["jobs_started"] += 1
            self.totals["queue_seconds"] += queue_ms / 1000
            self.last["queue_ms"] = round(queue_ms, 2)

    def record(self, runtime: Runtime, n_tokens: int) -> dict:
        """Account one finished generate_ids call; returns runtime.stats() for it."""
        stats = runtime.stats()
        gen = runtime.engine.stats
        with self._lock:
            for k, v in (("generated_tokens", n_tokens), ("prefilled_tokens", gen.prompt_tokens),
                         ("reused_tokens", gen.reused_tokens), ("steps", len(gen.steps)),
                         ("decode_seconds", gen.decode_s), ("bytes_streamed", stats.get("bytes_streamed", 0))):
                self.totals[k] += v
            self.last.update({"tokens_per_second": stats.get("decode_tok_s"),
                              "tokens_per_step": stats.get("tokens_per_step"),
                              "effective_gb_s": stats.get("effective_gbps")})
        return stats

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            totals, last = dict(self.totals), dict(self.last)
        steps, secs = totals["steps"], totals["decode_seconds"]
        started = totals["jobs_started"]
        return {**totals, "tokens_per_step": round(totals["generated_tokens"] / steps, 3) if steps else None,
                "tokens_per_second": round(totals["generated_tokens"] / secs, 2) if secs else None,
                "queue_wait_ms_mean": round(1000 * totals["queue_seconds"] / started, 2) if started else None,
                "last": last}


def _texts(pieces: Iterator[tuple[list[int], str]], ids: list[int], cancelled: threading.Event
           ) -> Iterator[tuple[str, int]]:
    """(new text, tokens it covers up to) after each step (Runtime.generate_text: held back while a character
    is incomplete or a stop string may begin, cut before one); collects the ids; stops early when cancelled."""
    for new, text in pieces:
        ids += new
        if text:
            yield text, len(ids)
        if cancelled.is_set():
            return


def _finish_reason(ids: list[int], limit: int, eos: set[int]) -> str:
    return "length" if len(ids) >= limit and not (ids and ids[-1] in eos) else "stop"


def run_choice(runtime: Runtime, job: Job, choice: int, ticket: Ticket, metrics: Metrics) -> bool:
    """Generate one choice, emitting its text as it comes; False when the ticket was cancelled."""
    p = choice // job.n
    prompt, limit = list(job.prompts[p]), job.max_tokens[p]
    if job.echo_texts:
        ticket.emit(Delta(choice, job.echo_texts[p]))
    ids: list[int] = []
    constraint = runtime.grammars.constraint(job.grammar) if job.grammar is not None else None
    gen = runtime.generate_text(prompt, limit, job.sampling_for(choice), job.stop, constraint, job.logprobs,
                                job.accept)
    covered = 0
    try:
        for text, upto in _texts(gen, ids, ticket.cancelled):
            records = runtime.engine.logprobs[covered:upto] if job.logprobs is not None else []
            covered = upto
            ticket.emit(Delta(choice, text, tuple(lp.entries(runtime.tokenizer, records))))
    finally:
        gen.close()
    stats = metrics.record(runtime, len(ids))
    if ticket.cancelled.is_set():
        return False
    reason = _finish_reason(ids, limit, runtime.engine.eos_ids)
    if constraint is not None and "limit" in constraint.stats:     # the grammar library could not go on: cut
        reason = "length"
    ticket.emit(Finished(choice, reason, len(prompt), len(ids), stats, tuple(ids)))
    return True


def run_job(runtime: Runtime, ticket: Ticket, metrics: Metrics, choices: range | None = None) -> None:
    """The ticket's choices in order (`choices`: this part's, when the job's choices run as sibling parts on
    several seats; None: all); the job's last part to end emits End (after Failed if a part raised)."""
    if ticket.begin_part():
        metrics.started(ticket.queue_ms)
    outcome = "jobs_completed"
    try:
        for choice in choices if choices is not None else range(ticket.job.choices):
            if ticket.cancelled.is_set() or not run_choice(runtime, ticket.job, choice, ticket, metrics):
                outcome = "jobs_cancelled"
                break
    except Exception as e:                   # noqa: BLE001 -- reported to the client; the worker lives on
        outcome = "jobs_failed"
        if ticket.settle(outcome):
            ticket.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
        ticket.cancelled.set()               # its siblings stop at their next step
    ticket.settle(outcome)
    if ticket.end_parts():
        _ended(ticket, metrics)


def _ended(ticket: Ticket, metrics: Metrics) -> None:
    """The job's last part ended: its outcome counted once, End emitted."""
    metrics.add(**{ticket.outcome: 1})
    ticket.emit(End(ticket.queue_ms))


class GenerationQueue:
    """FIFO of tickets and the `parallel` worker threads that run them (start() it; close() stops it). With
    parallel > 1 each worker is a seat of one SeatPool (specexec/batching/pool.py): the running requests' trees
    share each target pass, a request joins the passes when a worker takes it and leaves them when it ends
    (finished, cancelled, failed), and every running request advances one pass per pass (step-level fairness);
    over `parallel`, requests wait in arrival order. With seats, a job's n > 1 choices are sibling requests: one
    part per choice, each on a seat of its own (their prompts' prefills ride the same passes); the last part to
    end emits End."""

    def __init__(self, runtime: Runtime, max_queue: int = 64, parallel: int = 1) -> None:
        self.runtime, self.max_queue, self.parallel = runtime, max_queue, parallel
        self.metrics = Metrics()
        self.pool = SeatPool(runtime, parallel) if parallel > 1 else None
        self._waiting: collections.deque[tuple[Ticket, range | None]] = collections.deque()   # (job, its choices)
        self._cond = threading.Condition()
        self._running: dict[int, Ticket] = {}
        self._closed = False
        self._threads = torch.get_num_threads()    # intra-op threads of the starting thread, for the workers
        self._workers = [threading.Thread(target=self._work, args=(seat,), name=f"specexec-generate-{seat}",
                                          daemon=True) for seat in range(parallel)]

    def start(self) -> None:
        for worker in self._workers:
            worker.start()

    @property
    def depth(self) -> int:
        """Requests waiting (not counting the running ones)."""
        with self._cond:
            return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests running now."""
        with self._cond:
            return len(self._running)

    @property
    def busy(self) -> bool:
        return self.running > 0

    def forest(self) -> dict[str, float | None]:
        """The shared target passes so far: passes, requests they carried, the mean and the last pass's forest
        size (requests per pass); zeros with one request at a time."""
        if self.pool is None:
            return {"forest_passes": 0, "forest_requests": 0, "forest_size_mean": None, "forest_size_last": None}
        s = self.pool.forest.stats
        passes, calls = s.passes["target"], s.calls["target"]
        return {"forest_passes": passes, "forest_requests": calls,
                "forest_size_mean": round(calls / passes, 3) if passes else None,
                "forest_size_last": s.last_size.get("target")}

    def submit(self, job: Job) -> Ticket:
        """Queue `job` (from a running event loop); QueueFull when max_queue tickets already wait."""
        ticket = Ticket(job, asyncio.get_running_loop())
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting; retry later")
            ticket.on_cancel = self._drop
            if self.pool is not None and job.choices > 1:      # sibling requests: a seat each, sharing passes
                ticket.parts = job.choices
                self._waiting.extend((ticket, range(c, c + 1)) for c in range(job.choices))
            else:
                self._waiting.append((ticket, None))
            self._cond.notify_all()
        self.metrics.add(jobs_submitted=1)
        return ticket

    def _drop(self, ticket: Ticket) -> None:
        """A cancelled ticket's waiting parts leave the queue (its running ones stop at their next step)."""
        with self._cond:
            mine = [part for part in self._waiting if part[0] is ticket]
            for part in mine:
                self._waiting.remove(part)
        if mine and ticket.end_parts(len(mine)):       # no part of it runs any more
            ticket.settle("jobs_cancelled")
            if ticket.started:
                _ended(ticket, self.metrics)
            else:
                self.metrics.add(jobs_cancelled=1)      # it never ran: nothing else will count it

    def _next(self, seat: int) -> tuple[Ticket, range | None] | None:
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            part = self._waiting.popleft()
            self._running[seat] = part[0]
            return part

    def _work(self, seat: int) -> None:
        torch.set_num_threads(self._threads)
        while (part := self._next(seat)) is not None:
            runtime = self.pool.start(seat) if self.pool is not None else self.runtime
            try:
                run_job(runtime, part[0], self.metrics, part[1])
            finally:
                if self.pool is not None:
                    self.pool.end(seat)
                with self._cond:
                    self._running.pop(seat, None)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel the running job and every waiting one, then stop the worker."""
        with self._cond:
            self._closed = True
            waiting = list(dict.fromkeys(ticket for ticket, _ in self._waiting))
            self._waiting = collections.deque()
            self._cond.notify_all()
        for t in waiting:                        # the running ones end themselves at their next step
            t.cancelled.set()
            t.emit(End(0.0))
        with self._cond:
            running = list(self._running.values())
        for t in running:
            t.cancelled.set()
        for worker in self._workers:
            if worker.is_alive():
                worker.join(timeout)
        if not any(worker.is_alive() for worker in self._workers):
            self.runtime.engine.close()          # an offloaded target's pager thread
