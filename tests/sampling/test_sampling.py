"""specexec.sampling: logits processing matches transformers' own processors; sampling is seeded and unbiased."""
from __future__ import annotations

import math

import pytest
import torch

from specexec.config import SamplingParams
from specexec.sampling import (greedy, gumbel_topk, make_generator, node_histories, probs, process_logits,
                               sample)
from specexec.tree import TokenTree


def chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells expected below 5 counts are pooled into one."""
    n = float(counts.sum())
    exp = expected_probs.double() * n
    small = exp < 5
    obs = torch.cat([counts.double()[~small], counts.double()[small].sum().reshape(1)])
    exp = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def hf_process(logits: torch.Tensor, s: SamplingParams, history: torch.Tensor | None) -> torch.Tensor:
    """transformers' processors in generate()'s order, then log-softmax."""
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    ids = history if history is not None else torch.zeros(logits.shape[0], 0, dtype=torch.long)
    x = logits.clone()
    if s.repetition_penalty != 1.0 and ids.shape[1]:
        x = RepetitionPenaltyLogitsProcessor(float(s.repetition_penalty))(ids, x)
    if not s.greedy:
        x = TemperatureLogitsWarper(s.temperature)(ids, x)
        if s.top_k:
            x = TopKLogitsWarper(s.top_k)(ids, x)
        if s.top_p < 1.0:
            x = TopPLogitsWarper(s.top_p)(ids, x)
        if s.min_p > 0:
            x = MinPLogitsWarper(s.min_p)(ids, x)
    return torch.log_softmax(x, dim=-1)


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.5, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, repetition_penalty=0.7),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, top_k=3),
]


@pytest.mark.parametrize("s", CASES, ids=lambda s: repr(s)[15:60])
def test_process_logits_matches_transformers(s: SamplingParams) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 64, generator=g) * 3
    history = torch.randint(0, 64, (6, 12), generator=g)
    ours, ref = process_logits(logits, s, history), hf_process(logits, s, history)
    assert ours.dtype == torch.float32 and ours.shape == logits.shape
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(ours[fin], ref[fin], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs(logits, s, history), ref.exp(), rtol=1e-5, atol=1e-6)


def test_repetition_penalty_padding_and_one_row() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 40, generator=g)
    s = SamplingParams(temperature=1.0, repetition_penalty=1.8)
    rows = [[1, 5, 5, 39], [7], []]
    padded = torch.tensor([r + [-1] * (4 - len(r)) for r in rows])
    ours = process_logits(logits, s, padded)
    for i, r in enumerate(rows):
        ref = hf_process(logits[i:i + 1], s, torch.tensor([r], dtype=torch.long).reshape(1, -1))
        torch.testing.assert_close(ours[i], ref[0])
        torch.testing.assert_close(process_logits(logits[i], s, padded[i]), ref[0])


def test_greedy_is_argmax_of_penalised_logits() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    s = SamplingParams(temperature=0.0, repetition_penalty=2.0, top_k=1)
    out = process_logits(logits, s, torch.tensor([[1]]))         # 3.0 -> 1.5, so token 2 wins
    assert int(greedy(out)[0]) == 2 and torch.isfinite(out).all()
    assert greedy(torch.tensor([[0.0, 5.0, 5.0]])).tolist() == [1]


def test_seeds_reproduce() -> None:
    lp = torch.log_softmax(torch.randn(50, 30), dim=-1)
    a = sample(lp, make_generator(123))
    assert torch.equal(a, sample(lp, make_generator(123)))
    assert not torch.equal(a, sample(lp, make_generator(124)))
    assert torch.equal(gumbel_topk(lp[0], 5, make_generator(7))[0], gumbel_topk(lp[0], 5, make_generator(7))[0])


def test_sample_frequencies_match_probabilities() -> None:
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0])
    n = 100_000
    draws = sample(p.log().expand(n, -1), make_generator(5))
    counts = torch.bincount(draws, minlength=7).double()
    assert counts[6] == 0                                            # never a zero-probability token
    assert 0.5 * (counts / n - p).abs().sum() < 4 / math.sqrt(n)
    assert chi2_pvalue(counts, p) > 1e-3


def test_gumbel_topk_draw_order_and_distinct() -> None:
    q = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0, 0.0])
    lq, gen, n = q.log(), make_generator(11), 10_000
    first, second = torch.zeros(7), torch.zeros(7)
    for _ in range(n):
        toks, keys = gumbel_topk(lq, 4, gen)
        assert len(set(toks.tolist())) == 4 and bool((keys[:-1] >= keys[1:]).all())
        first[toks[0]] += 1
        second[toks[1]] += 1
    assert chi2_pvalue(first, q) > 1e-3
    exact_second = sum(q[x] * q.index_fill(0, torch.tensor([x]), 0.0) / (1 - q[x]) for x in range(5))
    assert chi2_pvalue(second, exact_second) > 1e-3
    toks, _ = gumbel_topk(lq, 7, gen)                               # zero-probability tail dropped
    assert sorted(toks.tolist()) == [0, 1, 2, 3, 4]
    rows, keys = gumbel_topk(torch.stack([lq, lq.flip(0)]), 6, gen)  # batched: tail marked -1 / -inf
    assert rows.shape == (2, 6) and rows[:, 5].tolist() == [-1, -1] and torch.isinf(keys[:, 5]).all()
    assert sorted(rows[1, :5].tolist()) == [2, 3, 4, 5, 6]


def test_node_histories() -> None:
    tree = TokenTree.from_lists([9, 4, 5, 6], [-1, 0, 0, 2])
    h = node_histories(tree, torch.tensor([1, 2]))
    assert h.shape == (4, 2 + 3)
    rows = [sorted(t for t in r if t >= 0) for r in h.tolist()]
    assert rows == [[1, 2, 9], [1, 2, 4, 9], [1, 2, 5, 9], [1, 2, 5, 6, 9]]


def test_node_histories_without_the_root_column_keep_multiplicity() -> None:
    """with_root=False: the prefix already ends with the root; each id appears as often as in the sequence."""
    tree = TokenTree.from_lists([9, 4, 9, 9], [-1, 0, 0, 2])
    h = node_histories(tree, torch.tensor([1, 9, 9]), with_root=False)
    assert h.shape == (4, 3 + 2)
    rows = [sorted(t for t in r if t >= 0) for r in h.tolist()]
    assert rows == [[1, 9, 9], [1, 4, 9, 9], [1, 9, 9, 9], [1, 9, 9, 9, 9]]
    root_only = node_histories(TokenTree.from_lists([7], [-1]), torch.tensor([7]), with_root=False)
    assert root_only.tolist() == [[7]]
