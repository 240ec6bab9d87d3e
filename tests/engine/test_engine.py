"""Greedy exactness of the speculative loop and the SpecExec builder's tree invariants, on tiny models (fp32).

SpecExec output must equal target-only greedy output token for token, whatever the draft: the target itself,
an unrelated random model, or a perturbed copy of the target; for several budgets including 1.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from specexec.builders.specexec import SpecExecBuilder
from specexec.config import EngineConfig, SamplingParams
from specexec.decoding.engine import Engine
from specexec.checkpoints.loading import load_model
from specexec.tree import TokenTree
from tests.tiny_models import load_pair_models, prompt

BUDGETS = [1, 2, 8, 32, 128]
N_NEW = 40


@pytest.fixture(scope="module")
def models(tiny_pair: tuple[Path, Path], tiny_perturbed_draft: Path):
    return load_pair_models(tiny_pair, tiny_perturbed_draft)


def run(target, draft, budget: int, ids: list[int], n_new: int = N_NEW) -> tuple[list[int], Engine]:
    builder = SpecExecBuilder() if draft is not None else None
    engine = Engine(target, draft, EngineConfig(budget=budget), builder)
    return [t for step in engine.generate(ids, n_new) for t in step], engine


@pytest.mark.slow
@pytest.mark.parametrize("draft_name", ["target", "random", "perturbed"])
def test_greedy_output_equals_target_only_decode(models, draft_name: str) -> None:
    for seed in (0, 1):
        ids = prompt(seed)
        want, base = run(models["target"], None, 1, ids)
        assert base.stats.summary(1, "none")["tokens_per_step"] == 1.0
        for budget in BUDGETS:
            got, engine = run(models["target"], models[draft_name], budget, ids)
            assert got == want, f"draft={draft_name} budget={budget} seed={seed}"
            assert all(s.tree_size <= budget for s in engine.stats.steps)


class RecordingBuilder(SpecExecBuilder):
    """SpecExec builder that keeps every tree it built (for checking what each step accepted)."""

    def __init__(self) -> None:
        super().__init__()
        self.trees: list[TokenTree] = []

    def build(self, *args, **kwargs) -> TokenTree:
        self.trees.append(super().build(*args, **kwargs))
        return self.trees[-1]


def chain_depth(tree: TokenTree, continuation: list[int]) -> int:
    """How deep the tree follows `continuation` from the root (children matched by token)."""
    node, depth = 0, 0
    while depth < len(continuation):
        nxt = [c for c in tree.children(node) if int(tree.tokens[c]) == continuation[depth]]
        if not nxt:
            return depth
        node, depth = nxt[0], depth + 1
    return depth


@pytest.mark.parametrize("budget", [1, 8, 64])
def test_self_draft_accepts_the_longest_argmax_chain_in_the_tree(models, budget: int) -> None:
    ids = prompt(3)
    want, _ = run(models["target"], None, 1, ids, 60)
    builder = RecordingBuilder()
    engine = Engine(models["target"], models["target"], EngineConfig(budget=budget), builder)
    done = 0
    for step, tree in zip(engine.generate(ids, 60), iter(lambda: builder.trees[-1], None)):
        expected = chain_depth(tree, want[done:]) + 1
        assert len(step) == min(expected, 60 - done)
        done += len(step)
    assert done == 60
    if budget > 1:
        assert engine.stats.summary(budget, "specexec")["tokens_per_step"] > 2.0


@torch.inference_mode()
def test_tree_is_budgeted_ancestor_closed_and_scored_by_the_draft(models) -> None:
    """Scores equal cumulative draft log-probs (+ depth * log decay) recomputed path by path without the cache."""
    draft = models["perturbed"]
    ids = prompt(4)
    engine = Engine(models["target"], draft, EngineConfig(budget=24), RecordingBuilder())
    steps = list(engine.generate(ids, 12))
    tree = engine.builder.trees[-1]
    context = ids + [t for s in steps[:-1] for t in s]          # the root of the last tree is context[-1]
    assert tree.size <= 24 and int(tree.tokens[0]) == context[-1]
    for node in range(1, tree.size + 1):
        p = int(tree.parents[node])
        assert 0 <= p < node
        siblings = tree.tokens[tree.parents == p].tolist()
        assert len(siblings) == len(set(siblings))
    log_decay = math.log(engine.builder.decay)
    for node in range(1, tree.size + 1):
        path = tree.path(node)
        seq = torch.tensor(context[:-1] + tree.tokens[path].tolist())
        logq = torch.log_softmax(draft.logits(draft(seq[None], torch.arange(seq.numel())[None])), -1)
        k = len(context) - 1
        want = sum(float(logq[k + i - 1, int(tree.tokens[n])]) for i, n in enumerate(path[1:], 1))
        assert abs(float(tree.scores[node]) - (want + len(path[1:]) * log_decay)) < 1e-3


def test_generation_stops_at_eos_and_max_new_tokens(models) -> None:
    ids = prompt(5)
    want, _ = run(models["target"], None, 1, ids, 30)
    eos = want[7]
    engine = Engine(models["target"], models["perturbed"], EngineConfig(budget=16), SpecExecBuilder(), (eos,))
    got = [t for s in engine.generate(ids, 30) for t in s]
    assert got == want[: want.index(eos) + 1]
    got, _ = run(models["target"], models["target"], 64, ids, 5)
    assert got == want[:5]


def test_stop_callback_truncates(models) -> None:
    ids = prompt(6)
    want, _ = run(models["target"], None, 1, ids, 30)
    engine = Engine(models["target"], models["target"], EngineConfig(budget=16), SpecExecBuilder())
    got = [t for s in engine.generate(ids, 30, should_stop=lambda g: 9 if len(g) >= 9 else None) for t in s]
    assert got == want[:9]


def test_long_prompt_prefills_in_chunks(models) -> None:
    ids = prompt(7, n=70)
    small = Engine(models["target"], models["random"], EngineConfig(budget=8, prefill_chunk=16), SpecExecBuilder())
    got = [t for s in small.generate(ids, 10) for t in s]
    want, _ = run(models["target"], None, 1, ids, 10)
    assert got == want


def test_empty_prompt_is_rejected(models) -> None:
    with pytest.raises(ValueError, match="empty"):
        next(Engine(models["target"], None, EngineConfig(), None).generate([], 4))


def test_sampling_is_seeded(models) -> None:
    ids = prompt(8)
    sp = SamplingParams(temperature=0.8, seed=123)
    a, _ = (lambda e: ([t for s in e.generate(ids, 20, sp) for t in s], e))(
        Engine(models["target"], models["perturbed"], EngineConfig(budget=16), SpecExecBuilder()))
    b, _ = (lambda e: ([t for s in e.generate(ids, 20, sp) for t in s], e))(
        Engine(models["target"], models["perturbed"], EngineConfig(budget=16), SpecExecBuilder()))
    assert a == b and len(a) == 20
