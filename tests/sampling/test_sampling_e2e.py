"""Sampling exactness end to end on tiny models: the speculative loop's emitted tokens are distributed as the
target's own processed distribution, for every exact verifier, and history-dependent penalties are applied
per tree node exactly as target-only decoding applies them.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specexec.builders.specexec import SpecExecBuilder
from specexec.config import EngineConfig, SamplingParams
from specexec.decoding.engine import Engine
from specexec.options import ConfigError
from specexec.checkpoints.loading import load_model
from tests.sampling.chi2 import chi2_pvalue
from tests.sampling.sampling_pairs import PROMPT, exact_pairs, sample_pairs

TRIALS = 800


@pytest.fixture(scope="module")
def models(tiny_small_pair: tuple[Path, Path], tiny_llama: Path):
    """(target, its perturbed copy, an unrelated random draft), 2 layers each: the checks below run the engine
    2,400 times, and what they test (the builder, the verifier, the sampling) does not depend on depth."""
    target, perturbed = tiny_small_pair
    return load_model(target), load_model(perturbed), load_model(tiny_llama)


_COUNTS: dict[tuple, torch.Tensor] = {}       # (verifier, draft_index, temperature) -> pair counts of TRIALS runs


def counts_for(models, verifier: str, draft_index: int, temperature: float) -> torch.Tensor:
    """Counts of the first two tokens over TRIALS seeded runs of the SpecExec engine (top_p 0.95), sampled once
    per module run: the negative control checks the same samples against a wrong distribution."""
    key = (verifier, draft_index, temperature)
    if key not in _COUNTS:
        engine = Engine(models[0], models[draft_index], EngineConfig(budget=6, verifier=verifier), SpecExecBuilder())
        _COUNTS[key] = sample_pairs(engine, SamplingParams(temperature=temperature, top_p=0.95), TRIALS)
    return _COUNTS[key]


@pytest.mark.slow
@pytest.mark.parametrize("verifier,draft_index,temperature", [
    ("sample_match", 1, 1.0), ("rrs", 1, 0.6), ("rrs", 2, 1.0)])
def test_first_two_tokens_follow_the_target_distribution(models, verifier: str, draft_index: int,
                                                         temperature: float) -> None:
    counts = counts_for(models, verifier, draft_index, temperature)
    exact = exact_pairs(models[0], SamplingParams(temperature=temperature, top_p=0.95))
    assert chi2_pvalue(counts, exact) > 1e-3


@pytest.mark.slow
def test_the_chi_square_check_can_fail(models) -> None:
    """Negative control: the same number of samples, drawn at temperature 1.0, checked against the distribution
    at 0.6, are rejected by the same check (the samples of the first case above, when it ran in this process)."""
    counts = counts_for(models, "sample_match", 1, 1.0)
    wrong = exact_pairs(models[0], SamplingParams(temperature=0.6, top_p=0.95))
    assert chi2_pvalue(counts, wrong) < 1e-6


def test_greedy_with_repetition_penalty_equals_target_only(models) -> None:
    target, draft = models[0], models[1]
    sampling = SamplingParams(repetition_penalty=1.8)
    base = Engine(target, None, EngineConfig(budget=1), None)
    want = [t for s in base.generate(PROMPT, 40, sampling) for t in s]
    plain = [t for s in base.generate(PROMPT, 40) for t in s]
    assert want != plain                                   # the penalty changes this decode
    for budget in (1, 8, 32):
        engine = Engine(target, draft, EngineConfig(budget=budget), SpecExecBuilder())
        assert [t for s in engine.generate(PROMPT, 40, sampling) for t in s] == want


def test_a_verifier_that_is_not_exact_for_the_builder_is_refused(models) -> None:
    engine = Engine(models[0], models[1], EngineConfig(verifier="rrs_wor"), SpecExecBuilder())
    with pytest.raises(ConfigError, match="not exact"):
        next(engine.generate(PROMPT, 4, SamplingParams(temperature=0.7)))


def test_second_call_reuses_the_shared_prefix(models) -> None:
    engine = Engine(models[0], models[1], EngineConfig(budget=8), SpecExecBuilder())
    first = [t for s in engine.generate(PROMPT, 10) for t in s]
    assert engine.stats.reused_tokens == 0 and engine.stats.prompt_tokens == len(PROMPT) - 1
    follow_up = PROMPT + first + [50, 51]
    second = [t for s in engine.generate(follow_up, 10) for t in s]
    assert engine.stats.reused_tokens >= len(PROMPT) + len(first) - 2
    fresh = Engine(models[0], None, EngineConfig(budget=1), None)
    assert second == [t for s in fresh.generate(follow_up, 10) for t in s]
