"""`--budget auto`: pick each step's tree budget from this machine's measured costs and this conversation's
acceptance (Sequoia tunes its tree offline; here it is online): docs/algorithms.md §16.

tokens/s(n) = E[tokens per step | budget n] / (draft_s(n) + target_s(n)).

- CostModel: target pass seconds and draft seconds per step as functions of the tree size, each a monotone
  piecewise-linear fit of measured (size, seconds) points (calibration passes plus every real step); it can
  be saved/loaded as JSON keyed by a fingerprint of the model/device/quantization/plan (where, and when:
  specexec/tuning/calibration.py, called by the runtime). For a streamed MoE target one more term: the
  expected seconds of the experts a pass routes to (the expected expert union, learned online).
- AcceptanceModel: how many tree nodes of each score rank the target accepted. Builders keep the best-scoring
  nodes, so a budget-n tree holds the nodes of rank < n and E[tokens | n] = 1 + sum_{r<n} P(rank r accepted).
  Ranks beyond the largest tree seen are extrapolated with a log-linear tail. Exponential forgetting lets it
  follow the text (code accepts far more than open chat).
- BudgetTuner: each step picks, from a geometric grid, the budget maximising expected tokens/s, normally
  moving at most one grid step up or down per step (bounded changes); it leaps straight to the grid's best
  budget when that predicts >= 1.5x the current one's tokens/s on measured costs (tokens/s(n) can have two
  hills: a SpecExec tree's drafting cost is flat over a range of sizes, and a one-step climber stays on
  whichever hill it reached first); and it probes a larger size now and then so the models keep seeing
  data beyond the current choice.

Does not know: models, trees beyond their scores and accepted nodes, or how passes are timed (callers pass
seconds in).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specexec.tuning.plan_pick import START_BUDGET, budget_grid, start_index
from specexec.tuning.store import read_json, write_json


@dataclass
class CurveFit:
    """Monotone piecewise-linear seconds(size) over measured points; running mean per size. Below the smallest
    measured size the curve is flat, or with `origin` a line through (0, 0): a cost that vanishes with the
    tree (drafting) then looks cheaper at unmeasured small sizes, so the tuner goes and measures them instead
    of never trying a budget below where it started."""

    points: dict[int, tuple[float, int]] = field(default_factory=dict)   # size -> (mean seconds, count)
    origin: bool = False

    def add(self, size: int, seconds: float, weight_cap: int = 20, provisional: bool = False) -> None:
        """One measured pass. provisional (a cold one): held with count 0 when its size is new, and ignored
        when it is not; the fit reads count-0 points only while there are no others, and the next sample of
        their size replaces them."""
        mean, n = self.points.get(size, (0.0, 0))
        if provisional:
            if size not in self.points:
                self.points[size] = (seconds, 0)
            return
        n = min(n + 1, weight_cap)                    # a capped count keeps following a drifting machine
        self.points[size] = (mean + (seconds - mean) / n, n)

    def __call__(self, size: int) -> float:
        if not self.points:
            return 0.0
        firm = {x: p for x, p in self.points.items() if p[1] > 0}
        points = firm or {x: (m, 1) for x, (m, _) in self.points.items()}
        xs = sorted(points)
        ys = _monotone([points[x][0] for x in xs], [points[x][1] for x in xs])
        if size <= xs[0]:
            return ys[0] * max(size, 0) / xs[0] if self.origin else ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if size <= x1:
                return y0 + (y1 - y0) * (size - x0) / (x1 - x0)
        if len(xs) == 1:
            return ys[0]
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        return ys[-1] + slope * (size - xs[-1])


def _monotone(ys: list[float], weights: list[int]) -> list[float]:
    """The weighted isotonic fit (pool adjacent violators, weights = sample counts): a bigger tree never
    costs less, and a size timed once during a slow spell is pooled with its well-measured neighbours instead
    of lifting every larger size to its spike (a running maximum did that)."""
    blocks: list[list[float]] = []                    # [mean, weight, sizes covered]
    for y, w in zip(ys, weights):
        blocks.append([y, float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, n1), (m2, w2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return [m for m, _, n in blocks for _ in range(n)]


@dataclass
class CostModel:
    """Seconds of a step as a function of the tree: target(rows) + experts(rows) + draft(nodes).

    `experts` is the MoE term (specexec/companions/experts.py: the expected seconds of bringing onto the device the
    experts a pass of `rows` rows routes to, from the run's routing statistics: docs/algorithms.md §22); then
    the `target` curve holds the rest of the pass (measured seconds less the expert seconds the same pass was
    modelled to cost, BudgetTuner.observe). None (a dense target, or every expert resident): the target curve
    is the whole pass, flat for a streamed dense target -- the special case."""

    target: CurveFit = field(default_factory=CurveFit)
    draft: CurveFit = field(default_factory=lambda: CurveFit(origin=True))      # no tree, no drafting
    experts: Callable[[int], float] | None = field(default=None, compare=False)

    def target_seconds(self, rows: int) -> float:
        """One verification pass over `rows` rows (the tree and its root)."""
        return self.target(rows) + (self.experts(rows) if self.experts is not None else 0.0)

    def step_seconds(self, budget: int) -> float:
        return self.target_seconds(budget + 1) + self.draft(budget)

    def to_json(self) -> dict:
        return {"target": {str(k): v for k, v in self.target.points.items()},
                "draft": {str(k): v for k, v in self.draft.points.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        def curve(d: dict, origin: bool = False) -> CurveFit:
            return CurveFit({int(k): (float(v[0]), int(v[1])) for k, v in d.items()}, origin)
        return cls(curve(data.get("target", {})), curve(data.get("draft", {}), origin=True))

    def save(self, path: Path, fingerprint: str) -> None:
        write_json(path, {"fingerprint": fingerprint, **self.to_json()})

    @classmethod
    def load(cls, path: Path, fingerprint: str) -> "CostModel | None":
        """The saved model if it was measured for this fingerprint; None when absent, stale or unreadable."""
        data = read_json(path)
        if data is None or data.get("fingerprint") != fingerprint:
            return None
        try:
            return cls.from_json(data)
        except (TypeError, ValueError, IndexError):
            return None


@dataclass
class AcceptanceModel:
    """Per score rank r: decayed counts of trees that had rank r, and of those where rank r was accepted."""

    decay: float = 0.9
    seen: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    accepted: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))

    def observe(self, scores: torch.Tensor, accepted_nodes: list[int]) -> None:
        """scores [N+1] of one tree (root first); accepted_nodes: accepted node indices (root included)."""
        n = scores.numel() - 1
        if n <= 0:
            return
        order = torch.sort(scores[1:].double().cpu(), descending=True, stable=True).indices + 1
        rank_of = torch.empty(n + 1, dtype=torch.long)
        rank_of[order] = torch.arange(n)
        hit = torch.zeros(n, dtype=torch.float64)
        nodes = [a for a in accepted_nodes if a > 0]
        if nodes:
            hit[rank_of[torch.tensor(nodes)]] = 1.0
        self._grow(n)
        self.seen *= self.decay
        self.accepted *= self.decay
        self.seen[:n] += 1.0
        self.accepted[:n] += hit

    def _grow(self, n: int) -> None:
        if self.seen.numel() < n:
            pad = n - self.seen.numel()
            self.seen = torch.cat([self.seen, torch.zeros(pad, dtype=torch.float64)])
            self.accepted = torch.cat([self.accepted, torch.zeros(pad, dtype=torch.float64)])

    prior_weight: float = 1.0       # pseudo-trees of the prior P(rank r accepted) = prior_top / (r + 1)
    prior_top: float = 0.7

    def rate(self, n: int | None = None) -> torch.Tensor:
        """P(rank r accepted) for ranks r < n (default: the ranks seen), data blended with a weak prior."""
        n = self.seen.numel() if n is None else n
        self._grow(n)
        prior = self.prior_top / torch.arange(1, n + 1, dtype=torch.float64)
        w = self.prior_weight
        return (self.accepted[:n] + w * prior) / (self.seen[:n] + w)

    def expected_tokens(self, budget: int) -> float:
        """1 (the bonus token) + the expected number of accepted tree nodes in a budget-`budget` tree."""
        known = min(budget, max(int((self.seen > 0.05).sum()), 4))
        rate = self.rate(known)
        total = 1.0 + float(rate[:budget].sum())
        if budget > known:
            total += self._tail(rate, known, budget)
        return total

    @staticmethod
    def _tail(rate: torch.Tensor, known: int, budget: int) -> float:
        """Ranks beyond the data: the last quarter's mean rate decays like 1/rank (a log-shaped gain)."""
        last = float(rate[3 * known // 4: known].mean())
        return last * (known - 1) * math.log((budget - 1 + 1e-9) / (known - 1))


@dataclass
class BudgetTuner:
    """Chooses the next step's budget; `observe` feeds it each finished step."""

    max_budget: int
    costs: CostModel = field(default_factory=CostModel)
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    start_budget: int = START_BUDGET
    probe_every: int = 8
    leap_gain: float = 1.5          # leap across the grid for a predicted gain of at least this factor
    steps: int = 0
    settled: bool = False           # the descent from start_budget is over (a choice that did not go down)
    cold_steps: int = 1             # the first steps heard: their seconds are provisional (observe)
    heard: int = 0

    def __post_init__(self) -> None:
        self.grid = budget_grid(self.max_budget)
        self.index = start_index(self.grid, self.start_budget)

    @property
    def budget(self) -> int:
        return self.grid[self.index]

    def rate(self, budget: int) -> float:
        """Expected tokens per second for a budget under the current models (0 when costs are unknown)."""
        seconds = self.costs.step_seconds(budget)
        return self.acceptance.expected_tokens(budget) / seconds if seconds > 0 else 0.0

    def next_budget(self) -> int:
        """The next step's budget: a probe one grid step up every `probe_every` steps; else a leap to the grid's
        best trusted budget when it predicts >= leap_gain x the current one's tokens/s (a far hill across a
        valley); else the best budget within one grid step (moving only for a > 2 % gain). `settled` turns
        true at the first choice that does not go down: until then the tuner is still descending from its
        start, and its steps show what those larger budgets cost, not what drafting at its choice does (the
        gate does not judge drafting on them: specexec/companions/gate.py)."""
        before = self.index
        budget = self._next()
        self.settled = self.settled or self.index >= before
        return budget

    def _next(self) -> int:
        self.steps += 1
        lo, hi = max(self.index - 1, 0), min(self.index + 1, len(self.grid) - 1)
        if self.steps % self.probe_every == 0 and hi > self.index:
            self.index = hi
            return self.budget
        rates = [self.rate(b) for b in self.grid]
        current = rates[self.index]
        far = max((i for i, b in enumerate(self.grid) if self.trusted(b)), key=rates.__getitem__, default=None)
        if far is not None and current > 0 and rates[far] >= self.leap_gain * current:
            self.index = far
            return self.budget
        best = max(range(lo, hi + 1), key=rates.__getitem__)
        if rates[best] > 1.02 * current:
            self.index = best
        return self.budget

    def trusted(self, budget: int) -> bool:
        """Whether rate(budget) rests on measurements enough to leap to it: the drafting cost at `budget` is
        measured, interpolated between measured tree sizes, or extrapolated at most one doubling beyond the
        largest (the acceptance tail that far is short too). Not below the smallest measured size: the line
        through (0, 0) there under-prices a concave cost, so smaller unmeasured budgets are reached one grid
        step at a time, each measured on the way. The target curve is calibrated over the whole grid."""
        sizes = self.costs.draft.points
        return bool(sizes) and bool(self.costs.target.points) and min(sizes) <= budget <= 2 * max(sizes)

    def forget_acceptance(self) -> None:
        """Start the walk again from the start budget with no acceptance heard (the prior alone), keeping the
        measured costs: for a warm-up generation whose acceptance says nothing of the prompts after it (a
        benchmark's "Hello"), while its seconds are this machine's."""
        self.acceptance = AcceptanceModel(decay=self.acceptance.decay, prior_weight=self.acceptance.prior_weight,
                                          prior_top=self.acceptance.prior_top)
        self.index, self.steps, self.settled = start_index(self.grid, self.start_budget), 0, False

    def predicted(self) -> tuple[float, float] | None:
        """(speculative tok/s at the best trusted budget, target-alone tok/s) as the models predict them now, or None
        while either cost is unmeasured or rests on a cold step alone (before the first step: known when this
        machine's costs for this run were kept from an earlier one; else after the first warm draft step)."""
        firm = [n for _, n in self.costs.draft.points.values() if n > 0]
        if not firm or not self.costs.target.points:
            return None
        plain_s = self.costs.target_seconds(1)
        rates = [self.rate(b) for b in self.grid if self.trusted(b)]      # not the line through (0, 0) below
        return (max(rates), 1.0 / plain_s) if rates and plain_s > 0 else None

    def best_budget(self) -> int:
        """The global optimum over the grid (what next_budget converges to)."""
        return max(self.grid, key=self.rate)

    def observe(self, tree_size: int, scores: torch.Tensor, accepted_nodes: list[int],
                draft_s: float, target_s: float, expert_s: float = 0.0) -> None:
        """A finished step; expert_s: what the cost model's MoE term says that pass's experts cost (the target
        curve learns the rest). The seconds of the first `cold_steps` steps hold one-off
        warm-up work (the draft's first tree passes: a 0.5B draft on a CPU took 20x its later time), and one
        such sample would price its size, and by extrapolation every larger one, out of reach for good (the
        tuner seldom goes back there, and a running mean kept the spike): they count as provisional points,
        which the next sample of their size replaces."""
        self.heard += 1
        cold = self.heard <= self.cold_steps
        self.costs.target.add(tree_size + 1, max(target_s - expert_s, 0.0), provisional=cold)
        self.costs.draft.add(max(tree_size, 1), draft_s, provisional=cold)
        self.acceptance.observe(scores, accepted_nodes)


def calibration_sizes(max_budget: int) -> list[int]:
    """Tree sizes timed once per machine/model/plan: 1, 16, 64, 256, 1024, ... up to max_budget."""
    sizes = [1] + [n for n in (16, 64, 256, 1024, 4096, 16384) if n < max_budget]
    return sizes + ([max_budget] if max_budget > 1 else [])
