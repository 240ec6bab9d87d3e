"""Sampling exactness on a hybrid target (tiny Qwen3.5 at 2 layers: a Gated DeltaNet layer with a state per tree
branch, then a gated full-attention layer) with a hybrid draft (its perturbed copy): the first two emitted tokens
over seeded runs follow the target's own joint distribution (Pearson chi-square), for a deterministic tree
verified by sample-and-match and for a tree drawn without replacement verified by recursive rejection sampling."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specexec.builders.registry import make_builder
from specexec.checkpoints.loading import load_model
from specexec.config import EngineConfig, SamplingParams
from specexec.decoding.engine import Engine
from tests.sampling.chi2 import chi2_pvalue
from tests.sampling.sampling_pairs import exact_pairs, sample_pairs
from tests.tiny_models import DRAFT_PERTURB, write_tiny_model

TRIALS = 800
SAMPLING = SamplingParams(temperature=1.0, top_p=0.95)


@pytest.fixture(scope="module")
def models(tiny_root: Path):
    """(target, draft): Qwen3.5 with one linear-attention layer and one full-attention layer (the checks run the
    engine 1,600 times; what they test, a state per tree branch under sampling, does not depend on depth) and
    its perturbed copy."""
    path = write_tiny_model(tiny_root / "hybrid-qwen3_5-2layers", "qwen3_5", seed=40, n_layers=2,
                            layer_types=["linear_attention", "full_attention"])
    draft = write_tiny_model(tiny_root / "hybrid-qwen3_5-2layers-draft", perturb=DRAFT_PERTURB, base=path, seed=30)
    return load_model(path), load_model(draft)


@pytest.mark.slow
@pytest.mark.parametrize("builder, verifier", [("specexec", "sample_match"), ("rsd", "rrs_wor")])
def test_first_two_tokens_follow_the_hybrid_target(models, builder: str, verifier: str) -> None:
    target, draft = models
    assert list(target.args.layer_types) == ["linear_attention", "full_attention"]
    engine = Engine(target, draft, EngineConfig(budget=6, verifier=verifier), make_builder(builder))
    counts = sample_pairs(engine, SAMPLING, TRIALS)
    exact = exact_pairs(target, SAMPLING)
    p = chi2_pvalue(counts, exact)
    print(f"\nchi-square p-value, {builder}/{verifier}: {p:.4f}")
    assert p > 1e-3
    wrong = exact_pairs(target, SamplingParams(temperature=0.3, top_p=0.95))
    q = chi2_pvalue(counts, wrong)
    print(f"against temperature 0.3 (the negative control): {q:.2e}")
    assert q < 1e-6                                          # the same samples against another distribution
