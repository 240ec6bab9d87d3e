"""Sampling in a forest keeps each request's distribution with its own seed: the first two tokens of requests
that share every pass (two prompts of different lengths, four requests a pass) follow each prompt's exact target
distribution (chi-square), and a seeded request gives the same tokens as alone."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from specexec.batching.seats import Forest
from specexec.builders.specexec import SpecExecBuilder
from specexec.checkpoints.loading import load_model
from specexec.config import EngineConfig, SamplingParams
from specexec.decoding.engine import Engine
from tests.sampling.chi2 import chi2_pvalue
from tests.sampling.sampling_pairs import PROMPT, exact_pairs

SAMPLING = SamplingParams(temperature=1.0, top_p=0.95)
OTHER = [1, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61]          # a longer prompt beside PROMPT
ROUNDS, SEATS = 200, 4                                                # 400 samples of each prompt


@pytest.fixture(scope="module")
def models(tiny_small_pair: tuple[Path, Path]):
    return load_model(tiny_small_pair[0]), load_model(tiny_small_pair[1])


def forest_counts(models, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts [V, V] of the first two tokens of PROMPT and of OTHER, seats 0, 2 and 1, 3 of a four-request
    forest, seeded 0, 1, ... across rounds."""
    target, draft = models
    forest = Forest({"target": target, "draft": draft})
    config = EngineConfig(budget=6, verifier="sample_match")
    engines = [Engine(forest.seat(i, "target"), forest.seat(i, "draft"), config, SpecExecBuilder())
               for i in range(SEATS)]
    V = target.args.vocab_size
    counts = [torch.zeros(V, V), torch.zeros(V, V)]
    for r in range(ROUNDS):
        out: list = [None] * SEATS

        def work(i: int) -> None:
            try:
                seeded = SamplingParams(**{**sampling.__dict__, "seed": r * SEATS + i})
                out[i] = [t for s in engines[i].generate(PROMPT if i % 2 == 0 else OTHER, 2, seeded) for t in s]
            finally:
                forest.leave(i)

        for i in range(SEATS):
            forest.join(i)
        threads = [threading.Thread(target=work, args=(i,)) for i in range(SEATS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i, ids in enumerate(out):
            counts[i % 2][ids[0], ids[1]] += 1
    assert forest.stats.sizes["target"][SEATS] > 0
    return counts[0], counts[1]


@pytest.mark.slow
def test_forest_sampling_keeps_each_requests_distribution(models) -> None:
    first, second = forest_counts(models, SAMPLING)
    p_first = chi2_pvalue(first, exact_pairs(models[0], SAMPLING))
    p_second = chi2_pvalue(second, exact_pairs(models[0], SAMPLING, OTHER))
    print(f"forest chi-square p-values: PROMPT {p_first:.4f}, OTHER {p_second:.4f}")
    assert p_first > 1e-3 and p_second > 1e-3
    wrong = exact_pairs(models[0], SamplingParams(temperature=0.6, top_p=0.95))     # the check can fail
    assert chi2_pvalue(first, wrong) < 1e-6
    assert chi2_pvalue(first, exact_pairs(models[0], SAMPLING, OTHER)) < 1e-6       # nor mixes the prompts
