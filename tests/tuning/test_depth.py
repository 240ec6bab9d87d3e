"""--draft-layers auto's chooser (specexec/tuning/depth.py): the ladder of candidate depths, the chain model's
expected tokens, the best depth by predicted tokens/s (a shallow depth that agrees well beats the deepest that
fits, which the old size rule took), and the verdict when the target alone wins. No torch, no models."""
from __future__ import annotations

import pytest

from specexec.tuning.depth import (MARGIN, DepthSample, choose_depth, depth_ladder, expected_tokens, predict)
from specexec.companions.gate import with_depth_verdict


def test_the_ladder_is_distinct_deepest_first_and_never_below_the_floor() -> None:
    assert depth_ladder(28) == (28, 21, 14, 9, 7)
    assert depth_ladder(14) == (14, 10, 7, 5, 4)
    assert depth_ladder(4) == (4, 3, 2)
    assert depth_ladder(3) == (3, 2) and depth_ladder(2) == (2,) and depth_ladder(1) == (1,)
    assert all(d >= 2 for k in range(2, 80) for d in depth_ladder(k)) and depth_ladder(40)[0] == 40


def test_expected_tokens_of_a_chain() -> None:
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.8, 16) == pytest.approx(sum(0.8 ** i for i in range(17)))


def test_predict_takes_the_best_chain_length() -> None:
    # a = 0.5, T = 1, t_d = 0.1: l=1: 1.5/1.1 = 1.364; l=2: 1.75/1.2 = 1.458; l=3: 1.875/1.3 = 1.442
    tok_s, chain = predict(DepthSample(4, 0.5, 0.1), target_s=1.0)
    assert chain == 2 and tok_s == pytest.approx(1.75 / 1.2)
    # each verified row adds its cost: a dearer pass favours shorter chains
    assert predict(DepthSample(4, 0.9, 0.01), 1.0, row_s=0.0)[1] > predict(DepthSample(4, 0.9, 0.01), 1.0, 0.2)[1]


def test_a_shallow_depth_that_agrees_well_beats_the_deepest_that_fits() -> None:
    """The old size rule took the most layers that fit (here 14 of 28); a depth of 7 that agrees 0.7 at a
    quarter of the cost drafts faster, and is chosen."""
    T = 0.100
    samples = [DepthSample(14, 0.85, 0.055), DepthSample(10, 0.78, 0.040), DepthSample(7, 0.70, 0.028),
               DepthSample(5, 0.40, 0.020), DepthSample(4, 0.20, 0.016)]
    choice = choose_depth(samples, 28, T)
    rates = {s.depth: predict(s, T)[0] for s in samples}
    assert choice.depth == max(rates, key=rates.get) == 7 != max(s.depth for s in samples)
    assert choice.tok_s == pytest.approx(rates[7]) and choice.alone_tok_s == pytest.approx(10.0)
    assert not choice.loses and choice.speedup > 1.2
    assert choice.line().startswith("draft depth 7 of 28: agreement 0.70, predicted ")
    assert "the target alone" in choice.line() and "gate" not in choice.line()
    assert choice.summary()["layers"] == 7 and choice.summary()["of"] == 28


def test_when_the_target_alone_wins_no_depth_pays_and_the_gate_goes_on() -> None:
    """The issue's CPU case: drafting 14 of 28 layers costs about half a target pass and agrees 1.35 tokens per
    pass's worth: every depth loses, the best of them is still named, and --gate auto becomes on."""
    T = 0.050
    samples = [DepthSample(14, 0.30, 0.026), DepthSample(7, 0.10, 0.014), DepthSample(4, 0.02, 0.009)]
    choice = choose_depth(samples, 28, T)
    assert choice.loses and choice.speedup < 1 / (1 + MARGIN) and choice.depth in (14, 7, 4)
    assert "no depth pays" in choice.line() and choice.summary()["loses"]
    assert with_depth_verdict("auto", choice.loses) == "on"
    assert with_depth_verdict("off", True) == "off" and with_depth_verdict("auto", False) == "auto"
    assert with_depth_verdict("on", False) == "on"


def test_a_tie_with_the_target_alone_is_not_a_loss() -> None:
    """Within the gate's margin a prediction is noise: it does not force the gate."""
    choice = choose_depth([DepthSample(4, 0.0, 0.0)], 8, target_s=1.0, alone_s=1.0)
    assert choice.speedup == pytest.approx(1.0) and not choice.loses


def test_ties_go_to_the_shallower_depth_and_samples_are_required() -> None:
    assert choose_depth([DepthSample(8, 1.0, 0.1), DepthSample(4, 1.0, 0.1)], 8, 1.0).depth == 4
    with pytest.raises(ValueError):
        choose_depth([], 8, 1.0)
