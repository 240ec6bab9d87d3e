"""OpenAI presence/frequency penalties: the penalty function by hand, and their exactness through the speculative
loop on tiny models (fp32): greedy output equals a target-only decode that applies process_logits with the
request's generated history one token at a time, for several builders and budgets, alone and with the
repetition penalty; earlier chat turns reused from the KV cache do not count; sampling keeps the penalised
distribution (chi-square on the first two tokens)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specexec.config import EngineConfig, SamplingParams
from specexec.decoding.engine import Engine
from specexec.builders.registry import make_builder
from specexec.options import ConfigError
from specexec.sampling import apply_presence_frequency, process_logits
from tests.sampling.chi2 import chi2_pvalue
from tests.sampling.sampling_pairs import exact_pairs, sample_pairs
from tests.tiny_models import load_pair_models, prompt

N_NEW = 40
PENALTIES = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.8),
    SamplingParams(presence_penalty=1.5, frequency_penalty=0.8, repetition_penalty=1.3),
]


@pytest.fixture(scope="module")
def models(tiny_pair: tuple[Path, Path], tiny_perturbed_draft: Path):
    return load_pair_models(tiny_pair, tiny_perturbed_draft)


@torch.inference_mode()
def reference(target, ids: list[int], n: int, sampling: SamplingParams, generated_from: int | None = None) -> list[int]:
    """Target-only greedy decode without a cache: each token is the argmax of process_logits over the last
    position's logits with the whole sequence as history, generated ids counted from `generated_from`
    (default: the end of the prompt)."""
    seq = list(ids)
    start = len(ids) if generated_from is None else generated_from
    for _ in range(n):
        x = torch.tensor(seq)
        logits = target.logits(target(x[None], torch.arange(x.numel())[None])[0, -1:])
        seq.append(int(process_logits(logits, sampling, x[None], start).argmax(-1)))
    return seq[len(ids):]


def run(engine: Engine, ids: list[int], n: int, sampling: SamplingParams) -> list[int]:
    return [t for step in engine.generate(ids, n, sampling) for t in step]


def test_presence_frequency_by_hand() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0]])
    generated = torch.tensor([[1, 1, 2, -1, 1], [3, -1, -1, -1, -1]])
    out = apply_presence_frequency(logits, generated, presence=0.5, frequency=0.25)
    # row 0: counts (0, 3, 1, 0) -> 1 - 0, 2 - 0.75 - 0.5, -1 - 0.25 - 0.5, 0.5; row 1: counts (0, 0, 0, 1)
    want = torch.tensor([[1.0, 0.75, -1.75, 0.5], [0.0, 0.0, 0.0, -0.75]])
    torch.testing.assert_close(out, want)
    negative = apply_presence_frequency(logits[:1], generated[:1], presence=-1.0, frequency=-2.0)
    torch.testing.assert_close(negative, torch.tensor([[1.0, 9.0, 2.0, 0.5]]))


def test_process_logits_counts_only_generated_columns_after_the_repetition_penalty() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 1.0])
    history = torch.tensor([1, 3, 3, 0, -1])          # prompt (1, 3) then generated (3, 0), padding
    s = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=1.0)
    # repetition over {0, 1, 3}: (1, -2, 0.5, 0.5); then generated counts (1, 0, 0, 1): -1.5 on ids 0 and 3
    want = torch.log_softmax(torch.tensor([-0.5, -2.0, 0.5, -1.0]), -1)
    torch.testing.assert_close(process_logits(logits, s, history, generated_from=2), want)
    only_generated = process_logits(logits, SamplingParams(frequency_penalty=1.0), history[2:])
    torch.testing.assert_close(only_generated, torch.log_softmax(torch.tensor([1.0, -1.0, 0.5, 0.0]), -1))
    assert torch.equal(process_logits(logits, s), torch.log_softmax(logits, -1))   # no history, no penalty
    hot = SamplingParams(temperature=2.0, frequency_penalty=1.0)      # temperature divides the penalised logits
    torch.testing.assert_close(process_logits(logits, hot, history[2:]),
                               torch.log_softmax(torch.tensor([1.0, -1.0, 0.5, 0.0]) / 2.0, -1))


@pytest.mark.parametrize("name,value", [("presence_penalty", 2.5), ("frequency_penalty", -2.01),
                                        ("presence_penalty", float("nan")), ("frequency_penalty", "1")])
def test_out_of_range_penalties_are_refused(name: str, value) -> None:
    with pytest.raises(ConfigError, match=name):
        SamplingParams(**{name: value})
    assert SamplingParams(presence_penalty=-2, frequency_penalty=2).needs_history
    assert not SamplingParams().needs_history


@pytest.mark.slow
@pytest.mark.parametrize("sampling", PENALTIES, ids=["presence", "frequency", "both+repetition"])
def test_greedy_with_penalties_equals_target_only_decode(models, sampling: SamplingParams) -> None:
    ids = prompt(11)
    want = reference(models["target"], ids, N_NEW, sampling)
    assert want != reference(models["target"], ids, N_NEW, SamplingParams())     # the penalty matters here
    base = Engine(models["target"], None, EngineConfig(budget=1), None)
    assert run(base, ids, N_NEW, sampling) == want
    for builder in ("specexec", "chain", "dynamic"):
        for budget in (4, 32):
            engine = Engine(models["target"], models["perturbed"], EngineConfig(budget=budget), make_builder(builder))
            assert run(engine, ids, N_NEW, sampling) == want, (builder, budget)
            if budget == 32:
                assert engine.stats.summary(budget, builder)["tokens_per_step"] > 1.0


@pytest.mark.parametrize("ids", [[1, 40, 41, 66], [1, 40, 41, 169], [1, 40, 41, 265]])
def test_the_root_counts_once_and_only_once_generated(models, ids: list[int]) -> None:
    """Prompts after which the target tends to repeat tokens at once: here counting the first tree's root (a
    prompt token) or counting a later root twice changes the greedy output, so these catch off-by-ones."""
    for sampling in PENALTIES:
        want = reference(models["target"], ids, 24, sampling)
        for builder, budget in (("specexec", 8), (None, 1)):
            engine = Engine(models["target"], models["perturbed"] if builder else None, EngineConfig(budget=budget),
                            make_builder(builder) if builder else None)
            assert run(engine, ids, 24, sampling) == want, (sampling, builder)


def test_earlier_turns_reused_from_the_cache_are_not_counted(models) -> None:
    sampling = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0)
    ids = prompt(12)
    engine = Engine(models["target"], models["perturbed"], EngineConfig(budget=16), make_builder("specexec"))
    first = run(engine, ids, 16, sampling)
    assert first == reference(models["target"], ids, 16, sampling)
    follow_up = ids + first + [50, 51]
    second = run(engine, follow_up, 16, sampling)
    assert engine.stats.reused_tokens >= len(ids) + len(first) - 2
    assert second == reference(models["target"], follow_up, 16, sampling)
    assert second != reference(models["target"], follow_up, 16, sampling, generated_from=len(ids))


@pytest.mark.slow
@pytest.mark.parametrize("verifier", ["sample_match", "rrs"])
def test_sampling_with_penalties_keeps_the_target_distribution(models, verifier: str) -> None:
    """The first two tokens at T = 1 with strong presence/frequency penalties, 100 seeded runs: a chi-square
    against the exact penalised pairs passes, and against the unpenalised pairs fails (after this prompt the
    unpenalised target often repeats its first token: total variation 0.56 between the two)."""
    ids, trials = [1, 40, 41, 169], 100
    sampling = SamplingParams(temperature=1.0, frequency_penalty=2.0, presence_penalty=2.0)
    engine = Engine(models["target"], models["perturbed"], EngineConfig(budget=6, verifier=verifier),
                    make_builder("specexec"))
    counts = sample_pairs(engine, sampling, trials, ids)
    assert chi2_pvalue(counts, exact_pairs(models["target"], sampling, ids)) > 1e-3
    assert chi2_pvalue(counts, exact_pairs(models["target"], SamplingParams(temperature=1.0), ids)) < 1e-6


def test_cli_flags_and_chat_set(tiny_pair: tuple[Path, Path], tiny_perturbed_draft: Path) -> None:
    import argparse
    import io

    from rich.console import Console

    from cli import args as common
    from cli.chat import ChatSession
    from specexec.runtime.assembly import Runtime

    parser = argparse.ArgumentParser()
    common.add_sampling_args(parser)
    parsed = parser.parse_args(["--presence-penalty", "0.5", "--frequency-penalty", "-1.25"])
    assert common.sampling_params(parsed) == SamplingParams(presence_penalty=0.5, frequency_penalty=-1.25)
    runtime = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), EngineConfig(budget=8, dtype="float32"))
    err = io.StringIO()
    chat = ChatSession(runtime, SamplingParams(), None, Console(file=err, width=200, no_color=True),
                       lambda _text: None, 8)
    chat.handle("/set presence_penalty 0.5")
    chat.handle("/set frequency-penalty 1.5")
    assert (chat.sampling.presence_penalty, chat.sampling.frequency_penalty) == (0.5, 1.5)
    assert "presence_penalty 0.5" in err.getvalue() and "frequency_penalty 1.5" in err.getvalue()
    chat.handle("/set frequency_penalty 2.5")
    assert chat.sampling.frequency_penalty == 1.5 and "frequency_penalty" in err.getvalue().splitlines()[-1]
