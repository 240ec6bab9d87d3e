"""Seats for the running requests of one loaded run: N engines of their own (caches, builder, tuner, sampler,
seed), whose target and draft are seats at one Forest (seats.py), so their passes ride the same forward.

`SeatPool.why_not(runtime)` says when a run cannot seat several requests (then a server runs one request at a
time, as before): a target a forest pass cannot batch (forest_pass.why_not: hybrids' recurrent state, latent
attention, mixtures of experts), or a draft that reads the target (a drafter such as EAGLE-3 or MTP, a
self-draft: the engine tells them apart by their type, which a seat does not have).

`seating(runtime, asked)` is how many requests a server runs at once (--parallel): each request's own caches
(its ledger: target and draft KV at the run's context), how many fit in the memory free where they live.

Does not know: HTTP, queues (specexec/serving/queue.py admits requests to seats), trees.
"""
from __future__ import annotations

from dataclasses import dataclass

from offload.planner import default_budgets
from specexec.batching.forest_pass import why_not as pass_why_not
from specexec.batching.seats import Forest
from specexec.kv.cache import kv_slots_for
from specexec.network.model import Transformer
from specexec.options import ConfigError
from specexec.planning.sizes import kv_bytes
from specexec.runtime.assembly import Runtime
from specexec.runtime.self_draft import SelfDraft


class SeatPool:
    """`size` seats over one Forest: runtimes[i] is seat i's Runtime; start(i) before its first call, end(i)
    after its last (a request's generation)."""

    def __init__(self, runtime: Runtime, size: int) -> None:
        problem = self.why_not(runtime)
        if problem is not None and size > 1:
            raise ValueError(f"this run cannot batch requests: {problem}")
        engine = runtime.engine
        draft = engine.draft if engine.builder is not None and engine.builder.needs_draft else None
        self.forest = Forest({"target": engine.target} | ({"draft": draft} if draft is not None else {}))
        self.runtimes = [runtime.seated(self.forest.seat(i, "target"),
                                        self.forest.seat(i, "draft") if draft is not None else None)
                         for i in range(size)]

    @staticmethod
    def why_not(runtime: Runtime) -> str | None:
        """None when requests of this run can share passes; else why not, in a few words."""
        engine = runtime.engine
        problem = pass_why_not(engine.target)
        if problem is not None:
            return f"the target has {problem}"
        draft = engine.draft
        if draft is not None and engine.builder is not None and engine.builder.needs_draft:
            if isinstance(draft, SelfDraft) or (isinstance(draft, Transformer)
                                                      and type(draft).forward is not Transformer.forward):
                return f"the draft ({type(draft).__name__}) reads the target"
        return None

    @property
    def size(self) -> int:
        return len(self.runtimes)

    def start(self, seat: int) -> Runtime:
        """Seat `seat` runs a request from now on: the passes wait for its calls. -> its Runtime."""
        self.forest.join(seat)
        return self.runtimes[seat]

    def end(self, seat: int) -> None:
        """Seat `seat`'s request ended (finished, cancelled, failed): the passes go on without it."""
        self.forest.leave(seat)


DEFAULT_PARALLEL = 4      # requests running at once when --parallel is not given (at most what fits)


@dataclass(frozen=True)
class Seating:
    """How many requests a server runs at once, and the ledger behind it: each request's own caches (the
    target's KV and the draft's, at the run's context), the memory free where they live, how many fit."""

    parallel: int
    target_kv: int
    draft_kv: int
    free: int
    fits: int
    context: int
    why_not: str | None = None

    @property
    def per_request(self) -> int:
        return self.target_kv + self.draft_kv

    def line(self) -> str:
        """The serve start line."""
        if self.why_not is not None:
            return f"parallel: 1 request at a time, as {self.why_not}; more requests queue"
        each = f"{_mb(self.per_request)} each (target KV {_mb(self.target_kv)}" + (
            f" + draft KV {_mb(self.draft_kv)}" if self.draft_kv else "") + f" at {self.context} tokens)"
        return (f"parallel: {self.parallel} requests share each pass; {each}; {self.fits} fit in the "
                f"{_mb(self.free)} free; more requests queue")


def _mb(n: int) -> str:
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.1f} MB"


def seating(runtime: Runtime, asked: int | None) -> Seating:
    """The requests a server runs at once: `asked` (--parallel), else what fits (at most DEFAULT_PARALLEL, at
    least 1). ConfigError when `asked` is more than fits; one at a time when the run cannot seat several."""
    engine = runtime.engine
    context = engine.planned_context or runtime.context
    budget = engine.config.budget
    with_draft = engine.draft is not None and engine.builder is not None and engine.builder.needs_draft
    t_slots, d_slots = kv_slots_for(context, budget, engine.builder.kv_slots(budget) if with_draft else None)
    elem = engine.target.norm.weight.element_size()                   # the caches' rows are in the run dtype
    target_kv = kv_bytes(engine.target.args, t_slots, elem, engine.config.kv_quant)
    draft_kv = kv_bytes(engine.draft.args, d_slots, elem, engine.draft_kv_quant) if with_draft else 0
    budgets = default_budgets(str(engine.device))
    free = budgets.gpu if engine.device.type == "cuda" else budgets.ram
    fits = max(1, free // max(target_kv + draft_kv, 1))
    problem = SeatPool.why_not(runtime)
    if problem is not None:
        return Seating(1, target_kv, draft_kv, free, fits, context, problem)
    if asked is not None and asked > fits:
        raise ConfigError(f"--parallel {asked}: only {fits} requests' caches fit ({_mb(target_kv + draft_kv)} each "
                          f"at {context} tokens, {_mb(free)} free); use --parallel {fits} or less")
    return Seating(asked if asked is not None else min(DEFAULT_PARALLEL, fits), target_kv, draft_kv, free, fits,
                   context)
