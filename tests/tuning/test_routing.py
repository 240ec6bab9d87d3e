"""specexec/tuning/routing.py: the expected expert union of a pass, and what RoutingStats learns from passes."""
from __future__ import annotations

import math

import pytest
import torch

from specexec.tuning.routing import (PRIOR_GAMMA, RoutingStats, solve_n_eff, union_size, union_sizes,
                                     uniform_union)


def test_union_of_independent_uniform_rows_is_the_closed_form() -> None:
    E, k = 128, 8
    p = [k / E] * E
    for n in (1, 17, 65, 257):
        want = E * (1 - (1 - k / E) ** n)
        assert union_size(p, n, gamma=1.0) == pytest.approx(want)
        assert uniform_union(E, k, n, gamma=1.0) == pytest.approx(want)
    assert union_size(p, 1) == pytest.approx(k)                  # one row reads exactly its k experts
    assert uniform_union(E, k, 17, cached=32) == pytest.approx(uniform_union(E, k, 17) * 96 / 128)


def test_caching_the_hottest_skips_the_likeliest() -> None:
    p = torch.tensor([0.9, 0.5, 0.3, 0.2, 0.1])                  # k = 2
    full = union_size(p, 4, gamma=1.0)
    assert union_size(p, 4, gamma=1.0, cached=2) == pytest.approx(full - (1 - 0.1 ** 4) - (1 - 0.5 ** 4))
    assert union_size(p, 4, gamma=1.0, cached=5) == 0.0


def test_n_eff_inverts_the_union() -> None:
    p = torch.softmax(torch.randn(3, 16, generator=torch.Generator().manual_seed(0)), -1) * 4
    for n in (1.0, 3.5, 20.0):
        u = union_sizes(p, n, gamma=1.0)
        assert solve_n_eff(p, u, 20.0) == pytest.approx(torch.full((3,), n, dtype=torch.float64), rel=1e-4)


def _pass(stats: RoutingStats, tokens: torch.Tensor, index: torch.Tensor) -> None:
    stats.observe(tokens, {layer: index[:, j] for j, layer in enumerate(stats.layers)})


def test_independent_rows_fit_gamma_near_one_and_duplicates_near_zero() -> None:
    g = torch.Generator().manual_seed(1)
    E, k, T = 16, 2, 12
    indep, dup = RoutingStats([0, 2], E, k), RoutingStats([0, 2], E, k)
    for step in range(60):
        rows = torch.stack([torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(2)]) for _ in range(T)])
        _pass(indep, torch.arange(T) + 100 * step, rows)                      # [T, L, k], every row its own
        _pass(dup, torch.arange(T), rows[:1].expand(T, -1, -1))             # every row routes as the first
    assert indep.gamma > 0.9 and dup.gamma < 0.2
    assert indep.expected_union(T).tolist() == pytest.approx([E * (1 - (1 - k / E) ** (T ** indep.gamma))] * 2,
                                                              rel=0.15)
    assert (dup.expected_union(T) < 3.0).all()


def test_frequencies_follow_skewed_routing_and_rank_the_hottest() -> None:
    E, k = 8, 2
    stats = RoutingStats([5], E, k)
    hot = torch.tensor([[3, 6]])                                               # every row: experts 3 and 6
    for step in range(200):
        _pass(stats, torch.arange(32) + step, hot.expand(32, -1)[:, None])
    p = stats.frequencies()[0]
    assert p.sum().item() == pytest.approx(k) and p[3] > 0.95 and p[6] > 0.95
    assert set(stats.hottest(2)[0].tolist()) == {3, 6}
    assert stats.expected_union(16, cached=2)[0] < 0.2                       # the hot two are held


def test_a_token_that_routes_alike_each_time_gets_a_high_repeat_rate() -> None:
    g = torch.Generator().manual_seed(2)
    E, k, V = 16, 2, 40
    table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)])   # token -> its experts
    keyed, noise = RoutingStats([0], E, k), RoutingStats([0], E, k)
    for _ in range(50):
        tokens = torch.randint(0, V, (8,), generator=g)
        _pass(keyed, tokens, table[tokens][:, None])
        _pass(noise, tokens, torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(8)])[:, None])
    assert keyed.alpha > 0.9 and noise.alpha < 0.1
    probs = keyed.node_probs(torch.tensor([7, 1000]))                           # [N, L, E]; 1000 never seen
    assert probs.sum(-1).flatten().tolist() == pytest.approx([k, k], rel=1e-5)
    assert set(probs[0, 0].topk(k).indices.tolist()) == set(table[7].tolist())
    assert torch.allclose(probs[1, 0], keyed.frequencies()[0].float())


def test_the_prior_before_any_pass() -> None:
    stats = RoutingStats([0, 1, 2], 128, 8)
    assert stats.gamma == PRIOR_GAMMA and stats.alpha == 0.0
    assert stats.expected_union(17).tolist() == pytest.approx([uniform_union(128, 8, 17)] * 3)
    assert uniform_union(128, 8, 17) == pytest.approx(128 * (1 - (1 - 8 / 128) ** (17 ** PRIOR_GAMMA)))
    assert math.isclose(uniform_union(128, 8, 1), 8.0)
