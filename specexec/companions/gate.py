"""The gate (--gate, docs/algorithms.md §24): whether the next decoding step drafts (a speculative step) or runs
the target alone (a plain step), decided from this run's own measured rates, and how that decision meets the
decoding loop.

When a run gates (`gates`): --gate on always, off never, auto with --budget auto; and a self-draft whose every
measured depth loses to the target alone gates under auto even with a fixed --budget N (`with_depth_verdict`).

The decision (`Gate`):

    speculative tok/s  = tokens the last `window` speculative steps emitted / their draft + target seconds
    target-alone tok/s = 1 / seconds of a plain step (the median of the last few; before any was measured,
                         `prior`: the cost model's predicted one-row target pass, when it has one; the first
                         plain step comes after `least` speculative ones even then, since a prior from cold
                         calibration passes can be several times a warm step)

- Drafting: the gate switches off when the target alone is more than `margin` faster, judged over the
  speculative steps since drafting last (re)started -- a full `window` of them for a small lead, fewer (at least
  `least`) the larger the lead: window * margin / (lead - 1), a lead of 1.5 needs 2 margins' worth -- and
  confirmed by at least `confirm` measured plain steps (it asks for them first, and then judges like with like:
  the lead must hold over the speculative steps after those plain steps, not the colder ones before them). The
  first `cold` speculative steps are not heard at all (first reads of streamed weights, first calls at each
  shape: on the SSD tier they ran 6x slower than the steps after them). One plain step after every
  `refresh_every` speculative ones keeps the target-alone rate fresh (a bounded share: 1 / (refresh_every + 1)
  of the steps).
- Not drafting: it probes. After `gap` plain steps a burst of `burst` speculative steps; when the burst ran more
  than `margin` faster than the target alone, drafting resumes, otherwise the next gap doubles (up to `max_gap`).
  Every gap is long enough that probes take at most `probe_share` of the steps and of the time (a probe's
  measured seconds, plus what starting it cost -- the draft catching up on the tokens it skipped, `charge` --
  against the plain steps' over the gap). The first switch off, when decided on less than a `window` of steps,
  is probed back after `recheck` plain steps instead (a short run would otherwise never probe). 5 %: the slowdown a gated run may show against the target alone is
  about that share times the probes' shortfall, plus the steps before the first switch.
- Before the measured rates can judge: the `verdict` (BudgetTuner.predicted: the best trusted budget's tokens/s
  from this machine's measured draft and target costs and the acceptance so far, its prior at first, against the
  target alone's) is asked before each step until it answers -- before the first step when the costs were kept
  from an earlier run (tuning/calibration.py), else once a warm draft step was timed. When it predicts the target
  alone more than `margin` faster, drafting stops at once (a 32-token answer was over before cold + least +
  confirm steps) and is probed back after `recheck` plain steps; from then on only measurements decide.
Both ways the margin is the hysteresis: rates within it never switch the gate.

The loop's side (`Pilot`, one of the engine's companions: specexec/companions/roster.py): before each step it asks
`plain_next` which kind of step comes (a plain step is the engine's own draft-free step: a root-only tree the
target verifies), and once the step is timed `heard` takes its times:

- before a speculative step that follows plain ones, the draft catches up on the tokens it has not seen (one
  prefill of its pending tokens, span "catch-up"), so the probe's draft time is a normal step's; the catch-up's
  seconds are charged to the gate once known (Gate.charge: they count in the probes' share of the time, not in
  their rate); while the gate is off a new prompt is not prefilled into the draft either (Engine._start asks
  `drafting`), so a gated-off run's time to first token is the target alone's;
- the speculative steps whose budget the tuner chose while still descending from its first budget (down from
  16, a grid step or a leap at a time: budget.BudgetTuner.settled) are not heard by the gate: they show what those
  larger trees cost, not what drafting at the tuner's choice does (heard, they could switch drafting off for a
  whole run that drafting at the settled budget would have sped up);
- a plain step's target time is the tuner's one-row pass cost (the prior the gate reads when it has no plain
  step of its own yet), and the tuner never hears it as a tree (it would look like free drafting);
- every step is counted (stats.gate: plain_steps, speculative_steps), every switch counted and noted in one
  line on the profiler (chat and bench print it).

Does not know: trees, how steps are verified (the engine), how steps are timed (callers pass seconds in), why a
rate is what it is.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from specexec.builders.base import DraftState, Prefill, TreeBuilder
from specexec.companions.protocol import Step
from specexec.config import EngineConfig
from specexec.profiler import PLAIN_STEPS, SPECULATIVE_STEPS, SWITCHES, Profiler, Span
from specexec.tuning.budget import BudgetTuner

def gates(mode: str, auto_budget: bool) -> bool:
    """Whether a run with --gate `mode` gates drafting (auto: only with --budget auto)."""
    return mode == "on" or (mode == "auto" and auto_budget)


def with_depth_verdict(mode: str, drafting_loses: bool) -> str:
    """The --gate mode of a run once the self-draft's depth was chosen: auto becomes on when even the best
    depth is predicted to lose to the target alone (the gate then turns drafting off as it measures), else
    `mode` unchanged."""
    return "on" if mode == "auto" and drafting_loses else mode


@dataclass(frozen=True)
class Switch:
    """One change of the gate: drafting now on or off, the two rates that decided it and over how many
    speculative steps the speculative one was measured."""

    drafting: bool
    plain_tok_s: float
    speculative_tok_s: float
    steps: int

    def line(self, step: int | None = None) -> str:
        """What chat, generate and bench print: 'drafting off at step 17: target alone 8.1 tok/s > speculative
        6.9 tok/s (last 16 steps)'; a switch before the first step says what predicted it."""
        at = f" at step {step}" if step is not None else ""
        if not self.steps:
            return (f"drafting off{at}: target alone {self.plain_tok_s:.1f} tok/s > speculative "
                    f"{self.speculative_tok_s:.1f} tok/s predicted (this machine's measured costs, the acceptance "
                    "so far); probed after a few steps")
        if self.drafting:
            return (f"drafting on{at}: speculative {self.speculative_tok_s:.1f} tok/s > target alone "
                    f"{self.plain_tok_s:.1f} tok/s (probe of {self.steps} steps)")
        return (f"drafting off{at}: target alone {self.plain_tok_s:.1f} tok/s > speculative "
                f"{self.speculative_tok_s:.1f} tok/s (last {self.steps} steps)")


@dataclass
class Gate:
    """Schedules each step's kind (`next_plain`) and hears each step's outcome (`observe`)."""

    margin: float = 0.05
    window: int = 16
    least: int = 4
    refresh_every: int = 32
    confirm: int = 3
    burst: int = 4
    probe_share: float = 0.05
    max_gap: int = 512
    cold: int = 2
    recheck: int = 8
    prior: Callable[[], float | None] | None = field(default=None, compare=False)   # predicted plain step s
    # (speculative tok/s, target-alone tok/s) as this machine's measured costs and the acceptance heard so far
    # (its prior at first) predict them, or None while a cost is unmeasured: asked before each step until it
    # answers (before the first step when the costs were kept from an earlier run) or the measured rates can judge
    verdict: Callable[[], tuple[float, float] | None] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self.drafting = True
        self.initial: Switch | None = None      # the switch the verdict made, if any (noted once)
        self._verdict_open = self.verdict is not None
        self._spec: deque[tuple[int, float]] = deque(maxlen=self.window)   # (tokens, seconds) per step
        self._plain: deque[float] = deque(maxlen=8)                        # seconds per plain step
        self._since_on = 0          # speculative steps heard since drafting (re)started
        self._since_plain = 0       # speculative steps scheduled since the last plain one
        self._want_plain = 0        # plain steps asked for before a switch off is decided
        self._gap = self.first_gap
        self._plain_run = 0         # plain steps scheduled since drafting stopped or the last probe
        self._burst_left = 0        # probe steps still to schedule
        self._probe: list[tuple[int, float]] = []
        self._plains = 0            # plain steps scheduled so far
        self._charged = 0.0         # seconds spent starting probes since the last probe was judged (catch-up)
        self._cold_spec = self.cold  # first speculative steps not heard (cold)
        self._switched_off = False  # drafting was switched off once already

    @property
    def first_gap(self) -> int:
        """Plain steps before the first probe: burst / (burst + gap) <= probe_share."""
        return math.ceil(self.burst * (1 - self.probe_share) / self.probe_share)

    def plain_seconds(self) -> float | None:
        """Seconds of a plain step: the median of the measured ones, else the prior (None: unknown)."""
        if self._plain:
            return statistics.median(self._plain)
        return self.prior() if self.prior is not None else None

    def speculative_tok_s(self) -> float | None:
        seconds = sum(s for _, s in self._spec)
        return sum(t for t, _ in self._spec) / seconds if seconds > 0 else None

    def next_plain(self) -> bool:
        """Whether the next step runs the target alone (True) or drafts (False)."""
        if self._verdict_open:
            self._decide_early()
        if self.drafting:
            # the target alone never measured: after one speculative step when there is no prior, after `least`
            # when there is (a prior is a cost model's guess: a cold calibration pass ran 3x a warm one)
            unknown = not self._plains and self._since_plain >= (1 if self.plain_seconds() is None else self.least)
            if self._want_plain or unknown or self._since_plain >= self.refresh_every:
                self._want_plain = max(self._want_plain - 1, 0)
                self._since_plain, self._plains = 0, self._plains + 1
                return True
            self._since_plain += 1
            return False
        if self._burst_left:
            self._burst_left -= 1
            return False
        self._plain_run += 1
        if self._plain_run >= self._gap:            # the step after this one starts a probe
            self._plain_run, self._burst_left = 0, self.burst
        return True

    def _decide_early(self) -> None:
        """Drafting stops as soon as what is known (the verdict: this machine's measured draft and target costs
        and the acceptance, its prior at first) predicts the target alone more than `margin` faster: a short
        answer is over before the measured rates could say so (cold + least + confirm steps). Asked once it
        answers, and no more once the measured rates judge (`least` speculative steps heard). Then it is probed
        back after `recheck` plain steps, as a switch decided on few steps is, and judged on measurements."""
        predicted = self.verdict() if self._since_on < self.least and self.drafting else None
        if self._since_on >= self.least or not self.drafting:
            self._verdict_open = False
        if predicted is None:
            return
        self._verdict_open = False
        spec, plain = predicted
        if spec > 0 and plain > (1 + self.margin) * spec:
            self.drafting, self._switched_off, self._gap, self._plain_run = False, True, self.recheck, 0
            self.initial = Switch(False, plain, spec, 0)

    def charge(self, seconds: float) -> None:
        """What starting a probe cost besides its steps (the draft's catch-up prefill): the next gap is sized so
        that probes and their starts together stay within probe_share of the time. While drafting there is no
        probe to charge (a catch-up after a refresh step is part of drafting's own cost): ignored."""
        if not self.drafting:
            self._charged += max(seconds, 0.0)

    def observe(self, speculative: bool, tokens: int, seconds: float) -> Switch | None:
        """A finished step: its kind, the tokens it emitted and its draft + target seconds. Returns the switch
        it caused, if any."""
        if seconds <= 0:
            return None
        if not speculative:
            self._plain.append(seconds)
            return None
        if self._cold_spec:                          # first reads of streamed weights, first calls at each shape
            self._cold_spec -= 1
            return None
        if not self.drafting:
            self._probe.append((tokens, seconds))
            return self._judge_probe() if len(self._probe) >= self.burst else None
        self._spec.append((tokens, seconds))
        self._since_on += 1
        return self._judge_drafting()

    def _judge_drafting(self) -> Switch | None:
        plain_s, spec = self.plain_seconds(), self.speculative_tok_s()
        if plain_s is None or spec is None or self._since_on < self.least:
            return None
        plain = 1.0 / plain_s
        lead = plain / spec
        if lead <= 1 + self.margin or self._since_on < min(self.window * self.margin / (lead - 1), self.window):
            return None
        if len(self._plain) < self.confirm:          # measure the target alone before trusting it, and judge
            self._want_plain = self.confirm - len(self._plain)      # like with like: the speculative steps
            self._spec.clear()                                       # after those plain steps, not the colder
            self._since_on = 0                                       # ones before them
            return None
        self.drafting, self._plain_run, self._burst_left = False, 0, 0
        self._gap = max(self.first_gap, self._time_gap(self.burst * statistics.median(s for _, s in self._spec)))
        if not self._switched_off and len(self._spec) < self.window:    # decided on few steps: probe back soon
            self._gap = self.recheck
        self._switched_off = True
        self._probe = []
        return Switch(False, plain, spec, len(self._spec))

    def _time_gap(self, probe_s: float) -> int:
        """Plain steps whose time holds a probe of `probe_s` seconds at most probe_share of the whole."""
        plain_s = self.plain_seconds()
        return math.ceil(probe_s * (1 - self.probe_share) / self.probe_share / plain_s) if plain_s else 0

    def _judge_probe(self) -> Switch | None:
        probe, self._probe = self._probe, []
        seconds = sum(s for _, s in probe)
        spec = sum(t for t, _ in probe) / seconds
        plain_s = self.plain_seconds()
        charged, self._charged = self._charged, 0.0
        if plain_s is not None and spec <= (1 + self.margin) / plain_s:
            self._gap = max(min(2 * self._gap, self.max_gap), self._time_gap(seconds + charged))
            return None
        self.drafting, self._since_on, self._since_plain = True, len(probe), 0
        self._spec.clear()
        self._spec.extend(probe)
        return Switch(True, 1.0 / plain_s if plain_s else 0.0, spec, len(probe))



class StepGate(Protocol):
    """What the pilot needs of a gate (Gate; tests pass scripted ones)."""

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
        verdict = tuner.predicted if tuner is not None else None
        return cls(Gate(prior=prior, verdict=verdict), profiler, prefill, tuner)

    @property
    def drafting(self) -> bool:
        """Whether the gate is drafting now (off: a new prompt's draft prefill waits for the next probe)."""
        return getattr(self.gate, "drafting", True)

    def plain_next(self, draft: DraftState | None) -> bool:
        """Whether the next step runs the target alone; before a speculative one the draft catches up."""
        plain = self.gate.next_plain()
        initial = getattr(self.gate, "initial", None)
        if initial is not None:                     # decided on the verdict: said once, counted
            self.gate.initial = None
            counted = self.profiler.counters
            step = int(counted.get(PLAIN_STEPS, 0) + counted.get(SPECULATIVE_STEPS, 0)) + 1
            self.profiler.count(**{SWITCHES: 1})
            self.profiler.note(initial.line(step))
        self._kinds.append(plain)
        self.profiler.count(**{PLAIN_STEPS if plain else SPECULATIVE_STEPS: 1})
        if not plain and draft is not None and len(draft.pending) > 1:
            with self.profiler.span("catch-up") as span:
                draft.catch_up(self.prefill)
            self._catch_ups.append(span)
        return plain

    def before_step(self, step: Step) -> None:
        """(A companion: specexec/companions/protocol.py) The step is plain when the gate says so: the root alone."""
        if self.plain_next(step.draft):
            step.limit(0)

    def timed(self, step: Step) -> None:
        """(A companion) The step's times, as `heard` takes them."""
        self.heard(step.tree.size, len(step.accepted.tokens), step.draft_s, step.target_s, step.expert_s,
                   step.settling)

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
