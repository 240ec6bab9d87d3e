"""Seats at one forest: each running request (a member) calls its models through a Seat, and the Forest gathers
the members' calls into one pass per model (forest_pass.py).

A Seat stands in for a model (the target or the draft) in one request's Engine: every attribute is the model's,
but calling it hands the forward to the Forest and waits. The Forest runs a pass when every member that has
joined is waiting for one (so a pass carries one call of each running request): the draft's calls first when
any member waits on the draft (they are cheap and the trees they grow ride the next target pass), else every
waiting target call. The member whose call completes the set runs the pass in its own thread; the others wait on
a condition. Members join and leave between their calls (at step boundaries: a request that ends or is
cancelled leaves, and the next pass goes on without it), so passes never wait for a member that is gone.

Each request keeps its own Engine: caches, builder state, sampler and seed; a request's rows see only its own
cache (forest_pass.py), so its output is what it would be alone. A pass of one call is the model's own forward
(bit for bit the solo run); calls a forest pass cannot take (forest_pass.Call.of, why_not) run one after another
inside the same turn.

Counts (`stats`): passes and calls per model, the rows of the last pass, and the forest sizes seen.

Does not know: engines, trees, HTTP, which request is which (members are small ints the caller picks).
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from specexec.batching.forest_pass import Call, forest_forward, why_not


@dataclass
class _Pending:
    """One member's call waiting for a pass: which model, its arguments, then its result or error."""

    which: str
    args: tuple
    kwargs: dict
    result: Any = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class ForestStats:
    """What the forest ran: passes and calls per model ("target", "draft"); sizes: how many passes carried
    n calls (per model); last_rows: the rows of each model's last pass."""

    passes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    sizes: dict[str, Counter] = field(default_factory=dict)
    last_rows: dict[str, int] = field(default_factory=dict)
    last_size: dict[str, int] = field(default_factory=dict)


class Forest:
    """The running requests' passes, gathered (module docstring). models: {"target": model, "draft": model}."""

    def __init__(self, models: dict[str, torch.nn.Module]) -> None:
        self.models = models
        self.batchable = {which: why_not(m) is None for which, m in models.items()}
        self._cond = threading.Condition()
        self._members: set[int] = set()
        self._waiting: dict[int, _Pending] = {}
        self._running = False
        self.stats = ForestStats()

    def why_not(self, which: str = "target") -> str | None:
        """None when `which` model's passes batch; else why they run one request after another."""
        return why_not(self.models[which])

    @property
    def running(self) -> int:
        """Members now running (joined, not left)."""
        with self._cond:
            return len(self._members)

    def join(self, member: int) -> None:
        """`member` takes part in the passes from now on (a request starts)."""
        with self._cond:
            self._members.add(member)

    def leave(self, member: int) -> None:
        """`member` ends (finished, cancelled, failed): the passes no longer wait for it."""
        with self._cond:
            self._members.discard(member)
            self._waiting.pop(member, None)
            self._cond.notify_all()

    def seat(self, member: int, which: str) -> Seat:
        """The stand-in for model `which` that `member`'s engine calls."""
        return Seat(self, member, which, self.models[which])

    def call(self, member: int, which: str, args: tuple, kwargs: dict) -> Any:
        """`member`'s forward of model `which`: waits for the pass that carries it (run by whichever member's
        call completes the set, maybe this one) -> what the model's forward returns."""
        mine = _Pending(which, args, kwargs)
        with self._cond:
            if member not in self._members:
                raise RuntimeError(f"member {member} calls the forest without having joined it")
            self._waiting[member] = mine
            self._cond.notify_all()
            while not mine.done:
                if self._running or len(self._waiting) < len(self._members):
                    self._cond.wait()
                    continue
                batch = self._take()
                self._running = True
                self._cond.release()
                try:
                    self._run(batch)
                finally:
                    self._cond.acquire()
                    self._running = False
                    self._cond.notify_all()
        if mine.error is not None:
            raise mine.error
        return mine.result

    def _take(self) -> list[_Pending]:
        """The calls of the next pass (every member waits): the draft's when any member waits on the draft,
        else the target's; in member order. They leave the waiting set."""
        which = "draft" if any(p.which == "draft" for p in self._waiting.values()) else "target"
        members = sorted(m for m, p in self._waiting.items() if p.which == which)
        return [self._waiting.pop(m) for m in members]

    def _run(self, batch: list[_Pending]) -> None:
        """One pass over the batch's calls; each gets its result or the pass's error."""
        which = batch[0].which
        model = self.models[which]
        s = self.stats
        s.passes[which] += 1
        s.calls[which] += len(batch)
        s.sizes.setdefault(which, Counter())[len(batch)] += 1
        s.last_size[which] = len(batch)
        try:
            calls = [Call.of(p.args, p.kwargs) for p in batch]
            s.last_rows[which] = sum(int(p.args[0].shape[-1]) for p in batch if p.args)
            with torch.inference_mode():      # (thread-local: the engine's generate holds it in its own thread)
                if len(batch) > 1 and self.batchable[which] and all(c is not None for c in calls):
                    for p, out in zip(batch, forest_forward(model, calls)):
                        p.result = out
                else:
                    for p in batch:
                        p.result = model(*p.args, **p.kwargs)
        except BaseException as e:          # noqa: BLE001 -- every member of the pass hears it, in its own thread
            for p in batch:
                p.error = e
        finally:
            for p in batch:
                p.done = True


class Seat:
    """A model as one member of a Forest sees it: its attributes are the model's; a call is a forest call.
    `captures` is False: a draft's CUDA graphs (builders/draft_graphs.py) would capture the seat, not a forward."""

    captures = False

    def __init__(self, forest: Forest, member: int, which: str, model: torch.nn.Module) -> None:
        self.__dict__.update(_forest=forest, _member=member, _which=which, _model=model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._forest.call(self._member, self._which, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_model"], name)

    @property
    def model(self) -> torch.nn.Module:
        """The model this seat stands in for."""
        return self._model
