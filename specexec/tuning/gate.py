"""The gate: whether the next decoding step drafts (a speculative step) or runs the target alone (a plain step),
decided from this run's own measured rates (docs/algorithms.md §24).

    speculative tok/s  = tokens the last `window` speculative steps emitted / their draft + target seconds
    target-alone tok/s = 1 / seconds of a plain step (the median of the last few; before any was measured,
                         `prior`: the cost model's predicted one-row target pass, when it has one; the first
                         plain step comes after `least` speculative ones even then, since a prior from cold
                         calibration passes can be several times a warm step)

- Drafting: the gate switches off when the target alone is more than `margin` faster, judged over the
  speculative steps since drafting last (re)started -- a full `window` of them for a small lead, fewer (at least
  `least`) the larger the lead: window * margin / (lead - 1), a lead of 1.5 needs 2 margins' worth -- and confirmed by
  at least `confirm` measured plain steps (it asks for them first). One plain step after every `refresh_every` speculative ones keeps the
  target-alone rate fresh (a bounded share: 1 / (refresh_every + 1) of the steps).
- Not drafting: it probes. After `gap` plain steps a burst of `burst` speculative steps; when the burst ran more
  than `margin` faster than the target alone, drafting resumes, otherwise the next gap doubles (up to `max_gap`).
  Every gap is long enough that probes take at most `probe_share` of the steps and of the time (a probe's
  measured seconds, plus what starting it cost -- the draft catching up on the tokens it skipped, `charge` --
  against the plain steps' over the gap). 5 %: the slowdown a gated run may show against the target alone is
  about that share times the probes' shortfall, plus the steps before the first switch.
Both ways the margin is the hysteresis: rates within it never switch the gate.

Does not know: models, trees, the engine, or how steps are timed (callers pass seconds in); no torch.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

PLAIN_STEPS, SPECULATIVE_STEPS, SWITCHES = "gate_plain_steps", "gate_speculative_steps", "gate_switches"


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
        6.9 tok/s (last 16 steps)'."""
        at = f" at step {step}" if step is not None else ""
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
    prior: Callable[[], float | None] | None = field(default=None, compare=False)   # predicted plain step s

    def __post_init__(self) -> None:
        self.drafting = True
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
        if len(self._plain) < self.confirm:          # measure the target alone before trusting it
            self._want_plain = self.confirm - len(self._plain)
            return None
        self.drafting, self._plain_run, self._burst_left = False, 0, 0
        self._gap = max(self.first_gap, self._time_gap(self.burst * statistics.median(s for _, s in self._spec)))
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


def gate_stats(counters: Mapping[str, float], events: Iterable[str]) -> dict | None:
    """stats.gate from the profiler's counters and notes: switches, plain_steps, speculative_steps and the
    switch lines (events); None when no step was gated."""
    plain, spec = counters.get(PLAIN_STEPS, 0), counters.get(SPECULATIVE_STEPS, 0)
    if not plain and not spec:
        return None
    return {"switches": int(counters.get(SWITCHES, 0)), "plain_steps": int(plain), "speculative_steps": int(spec),
            "events": list(events)}
