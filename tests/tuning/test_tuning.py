"""The budget optimiser on synthetic cost and acceptance curves (no models): flat pass cost -> a large budget,
linear pass cost -> a small one, and it moves down when acceptance drops."""
from __future__ import annotations

from pathlib import Path

import torch

from specexec.tuning.budget import AcceptanceModel, BudgetTuner, CostModel, CurveFit, budget_grid

MAX = 1024


def fit(fn, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1025)) -> CurveFit:
    c = CurveFit()
    for n in sizes:
        c.add(n, fn(n))
    return c


def feed(tuner: BudgetTuner, accept_prob, steps: int = 40, size: int = MAX, seed: int = 0) -> None:
    """Trees of `size` nodes scored by rank; rank r is accepted as part of a chain with prob accept_prob(r)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.cat([torch.zeros(1), -torch.arange(1, size + 1, dtype=torch.float32)])
    for _ in range(steps):
        accepted = [0]
        for r in range(size):
            if torch.rand(1, generator=g).item() >= accept_prob(r):
                break
            accepted.append(r + 1)
        tuner.acceptance.observe(scores, accepted)


def converge(tuner: BudgetTuner, steps: int = 60) -> int:
    for _ in range(steps):
        tuner.next_budget()
    return tuner.best_budget()


def test_flat_pass_cost_picks_a_large_budget() -> None:
    tuner = BudgetTuner(MAX, CostModel(fit(lambda n: 1.5), fit(lambda n: 0.05)))
    feed(tuner, lambda r: 0.97 ** (r / 8))
    assert converge(tuner) >= 256


def test_linear_pass_cost_picks_a_small_budget() -> None:
    tuner = BudgetTuner(MAX, CostModel(fit(lambda n: 0.02 + 0.004 * n), fit(lambda n: 0.002 * n)))
    feed(tuner, lambda r: 0.97 ** (r / 8))
    assert converge(tuner) <= 32


def test_budget_moves_down_when_acceptance_drops() -> None:
    tuner = BudgetTuner(MAX, CostModel(fit(lambda n: 0.2 + 0.0008 * n), fit(lambda n: 0.0002 * n)))
    feed(tuner, lambda r: 0.99)
    high = converge(tuner)
    feed(tuner, lambda r: 0.0, steps=60, seed=1)
    low = converge(tuner)
    assert low < high and low <= 16, (high, low)


def test_next_budget_moves_one_grid_step_at_a_time() -> None:
    tuner = BudgetTuner(MAX, CostModel(fit(lambda n: 1.0), fit(lambda n: 0.0)), start_budget=16)
    feed(tuner, lambda r: 0.999)
    seen = [tuner.budget] + [tuner.next_budget() for _ in range(10)]
    for a, b in zip(seen, seen[1:]):
        assert b in (a, a * 2, a // 2, MAX) or a == MAX
    assert seen[-1] > 16


def test_expected_tokens_matches_the_observed_rank_rates() -> None:
    model = AcceptanceModel(decay=1.0, prior_weight=0.0)
    scores = torch.tensor([0.0, -1.0, -2.0, -3.0, -4.0])
    for _ in range(10):
        model.observe(scores, [0, 1, 2])          # the two best-ranked nodes are always accepted
    assert abs(model.expected_tokens(2) - 3.0) < 1e-6
    assert abs(model.expected_tokens(4) - 3.0) < 1e-6


def test_cost_model_round_trips_and_rejects_a_stale_fingerprint(tmp_path: Path) -> None:
    costs = CostModel(fit(lambda n: 0.1 * n), fit(lambda n: 0.01))
    costs.save(tmp_path / "costs.json", "fp-1")
    again = CostModel.load(tmp_path / "costs.json", "fp-1")
    assert again is not None and abs(again.step_seconds(64) - costs.step_seconds(64)) < 1e-9
    assert CostModel.load(tmp_path / "costs.json", "fp-2") is None
    (tmp_path / "costs.json").write_text("{not json")
    assert CostModel.load(tmp_path / "costs.json", "fp-1") is None


def test_grid_and_curve_fit_basics() -> None:
    assert budget_grid(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    c = fit(lambda n: 1.0 + n, sizes=(1, 10))
    assert c(5) == 6.0 and c(20) == 21.0 and c(0) == 2.0


def test_an_unmeasured_smaller_budget_is_explored_when_drafting_cost_shrinks_with_it() -> None:
    # Steps so far ran at 16 and 32 only; drafting costs ~1.5 ms per node and the pass is flat (a fast target).
    draft = CurveFit(origin=True)
    for n in (16, 32):
        draft.add(n, 0.0015 * n)
    tuner = BudgetTuner(MAX, CostModel(fit(lambda n: 0.005), draft), start_budget=16)
    feed(tuner, lambda r: 0.6 ** (r + 1), size=32)
    assert draft(4) < draft(16) and CurveFit({16: (0.024, 1)})(4) == 0.024     # flat without the origin anchor
    assert tuner.next_budget() < 16                                             # it goes and measures below


def test_one_slow_sample_does_not_lift_every_larger_size() -> None:
    """A size timed once during a slow spell is pooled with its well-measured neighbours (weighted isotonic
    fit); a running maximum lifted every larger size to the spike, so the tuner fled large budgets."""
    c = CurveFit()
    for _ in range(20):
        for n, s in ((4, 0.10), (16, 0.11), (64, 0.12)):
            c.add(n, s)
    c.add(8, 0.50)                                   # one spike, count 1
    assert c(16) < 0.15 and c(64) < 0.15
    assert c(4) <= c(8) <= c(16) <= c(64)            # still monotone


def test_the_tuner_is_settling_while_it_descends_from_its_first_budget() -> None:
    """A linear pass cost from budget 16: each step goes down (a leap to budget 2 here) while settling, until a
    choice that does not go down; from then on it stays settled, probes up included."""
    tuner = BudgetTuner(MAX, CostModel(fit(lambda n: 0.02 + 0.004 * n), fit(lambda n: 0.002 * n)), start_budget=16)
    feed(tuner, lambda r: 0.5 ** r)
    trace = [(tuner.next_budget(), tuner.settled) for _ in range(12)]
    first = next(i for i, (_, settled) in enumerate(trace) if settled)
    budgets = [b for b, _ in trace]
    descent = [16] + budgets[:first]
    assert first >= 1 and all(b < a for a, b in zip(descent, descent[1:]))
    assert budgets[first] >= budgets[first - 1] and all(settled for _, settled in trace[first:])
    assert max(budgets[first:]) > budgets[first]                      # a probe up, settled all the same


def test_a_tuner_that_starts_at_its_best_budget_is_settled_at_once() -> None:
    tuner = BudgetTuner(MAX, CostModel(fit(lambda n: 1.5), fit(lambda n: 0.05)), start_budget=MAX)
    feed(tuner, lambda r: 0.97 ** (r / 8))
    tuner.next_budget()
    assert tuner.settled
