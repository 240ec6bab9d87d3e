"""The gate's glue in the decoding loop (--gate, docs/algorithms.md §24): before each step the engine asks
`plain_next` which kind of step comes (a plain step is the engine's own draft-free step: a root-only tree the
target verifies, i.e. the target alone), and after it `heard` gives the step's times. The decision is
specexec/tuning/gate.py's; here its bookkeeping meets the engine's:

- before a speculative step that follows plain ones, the draft catches up on the tokens it has not seen (one
  prefill of its pending tokens, span "catch-up"), so the probe's draft time is a normal step's; the catch-up's
  seconds are charged to the gate once known (Gate.charge: they count in the probes' share of the time, not in
  their rate); while the gate is off a new prompt is not prefilled into the draft either (Engine._start asks
  `drafting`), so a gated-off run's time to first token is the target alone's;
- the speculative steps whose budget the tuner chose while still descending from its first budget (down from
  16, a grid step or a leap at a time: budget.BudgetTuner.settled) are not heard by the gate: they show what those
  larger trees cost, not what drafting at the tuner's choice does (on the 0.5B/1.5B pair on a CPU they ran
  at half the target alone's rate and switched drafting off for a whole bench row);
- a plain step's target time is the tuner's one-row pass cost (the prior the gate reads when it has no plain
  step of its own yet), and the tuner never hears it as a tree (it would look like free drafting);
- every step is counted (stats.gate: plain_steps, speculative_steps), every switch counted and noted in one
  line on the profiler (chat and bench print it).

Does not know: trees, how steps are verified (the engine), why a rate is what it is.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from specexec.builders.base import DraftState, TreeBuilder
from specexec.config import EngineConfig
from specexec.profiler import Profiler, Span
from specexec.tuning.budget import BudgetTuner
from specexec.tuning.gate import PLAIN_STEPS, SPECULATIVE_STEPS, SWITCHES, Gate, Switch
from specexec.tuning.gate_modes import gates

Prefill = Callable[..., None]     # Engine.prefill(model, cache, ids, which, states=None)


class StepGate(Protocol):
    """What the pilot needs of a gate (specexec.tuning.gate.Gate; tests pass scripted ones)."""

    def next_plain(self) -> bool: ...

    def observe(self, speculative: bool, tokens: int, seconds: float) -> Switch | None: ...

    def charge(self, seconds: float) -> None: ...


class Pilot:
    """Chooses each step's kind through its gate and hears each step's outcome, in step order."""

    def __init__(self, gate: StepGate, profiler: Profiler, prefill: Prefill,
                 tuner: BudgetTuner | None = None) -> None:
        self.gate, self.profiler, self.prefill, self.tuner = gate, profiler, prefill, tuner
        self._kinds: deque[bool] = deque()          # scheduled steps not heard yet: True = plain
        self._catch_ups: list[Span] = []            # catch-up spans not charged to the gate yet

    @classmethod
    def for_engine(cls, config: EngineConfig, builder: TreeBuilder | None, tuner: BudgetTuner | None,
                   profiler: Profiler, prefill: Prefill) -> "Pilot | None":
        """The engine's pilot when config.gate says this run gates (never without a builder: nothing drafts)."""
        if builder is None or not gates(config.gate, config.auto_budget):
            return None
        prior = (lambda: tuner.costs.target_seconds(1) or None) if tuner is not None else None
        return cls(Gate(prior=prior), profiler, prefill, tuner)

    @property
    def drafting(self) -> bool:
        """Whether the gate is drafting now (off: a new prompt's draft prefill waits for the next probe)."""
        return getattr(self.gate, "drafting", True)

    def plain_next(self, draft: DraftState | None) -> bool:
        """Whether the next step runs the target alone; before a speculative one the draft catches up."""
        plain = self.gate.next_plain()
        self._kinds.append(plain)
        self.profiler.count(**{PLAIN_STEPS if plain else SPECULATIVE_STEPS: 1})
        if not plain and draft is not None and len(draft.pending) > 1:
            with self.profiler.span("catch-up") as span:
                draft.catch_up(self.prefill)
            self._catch_ups.append(span)
        return plain

    def heard(self, tree_size: int, tokens: int, draft_s: float, target_s: float, expert_s: float = 0.0,
              settling: bool = False) -> None:
        """A step's times settled (in step order): tokens it emitted, draft and target seconds, what the
        cost model's MoE term said its experts cost, and whether the tuner was still descending from its first
        budget when it chose this step's (settling: the gate does not hear such a speculative step)."""
        plain = self._kinds.popleft() if self._kinds else tree_size == 0
        for span in [s for s in self._catch_ups if s.ready]:        # CUDA: only once its events completed
            self.gate.charge(span.seconds)
            self._catch_ups.remove(span)
        if tree_size == 0 and self.tuner is not None:
            self.tuner.costs.target.add(1, max(target_s - expert_s, 0.0))
        if settling and not plain:
            return
        switch = self.gate.observe(not plain, tokens, draft_s + target_s)
        if switch is not None:
            counted = self.profiler.counters
            step = int(counted.get(PLAIN_STEPS, 0) + counted.get(SPECULATIVE_STEPS, 0)) - len(self._kinds)
            self.profiler.count(**{SWITCHES: 1})
            self.profiler.note(switch.line(step))
