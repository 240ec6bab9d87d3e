"""Seats for the running requests of one loaded run: N engines of their own (caches, builder, tuner, sampler,
seed), whose target and draft are seats at one Forest (seats.py), so their passes ride the same forward.

`SeatPool.why_not(runtime)` says when a run cannot seat several requests (then a server runs one request at a
time, as before): a target a forest pass cannot batch (forest_pass.why_not: hybrids' recurrent state, latent
attention, mixtures of experts), or a draft that reads the target (a drafter such as EAGLE-3 or MTP, a
self-draft: the engine tells them apart by their type, which a seat does not have).

Does not know: HTTP, queues (specexec/serving/forest_queue.py admits requests to seats), trees.
"""
from __future__ import annotations

from specexec.batching.forest_pass import why_not as pass_why_not
from specexec.batching.seats import Forest
from specexec.network.model import Transformer
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
            return f"the target has {problem}" if not problem.startswith("a ") else problem
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
