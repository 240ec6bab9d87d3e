"""A constraint masks both sides of a step (specexec/constraint.py): with a toy path-dependent matcher (a token
is allowed after a path unless (token + len(path) + sum(path)) % 3 == 0), every builder's greedy output equals
the target alone under the same mask, every emitted token obeys it, drafted trees hold no node the matcher
rejects (draft-grown builders) and the counters add up; a rejected path is dead, not an all -inf row."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from specexec.builders.registry import make_builder, names as builder_names
from specexec.config import EngineConfig
from specexec.constraint import GrammarLimit, MatcherConstraint, tree_paths, unpack_bits
from specexec.decoding.engine import Engine
from specexec.tree import TokenTree
from tests.tiny_models import load_pair_models, prompt

N_NEW = 24


def ok(prefix: Sequence[int], token: int) -> bool:
    return (token + len(prefix) + sum(prefix)) % 3 != 0


class ToyMatcher:
    """The Matcher protocol over the rule `ok`, counting its calls."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.done, self.calls = vocab, [], {"consume": 0, "rollback": 0, "fill": 0}
        self.ended = False

    def consume(self, tokens: Sequence[int]) -> int:
        self.calls["consume"] += 1
        n = 0
        for t in tokens:
            if not ok(self.done, t):
                break
            self.done.append(t)
            n += 1
        return n

    def rollback(self, n: int) -> None:
        self.calls["rollback"] += 1
        del self.done[len(self.done) - n:]

    def fill(self, out: torch.Tensor) -> None:
        self.calls["fill"] += 1
        allowed = torch.tensor([ok(self.done, t) for t in range(self.vocab)] + [False] * (32 * out.numel() - self.vocab))
        bits = (allowed.view(-1, 32).long() << torch.arange(32)).sum(dim=1)
        out.copy_(torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32))


def toy(vocab: int) -> MatcherConstraint:
    return MatcherConstraint(ToyMatcher(vocab), vocab)


class Recording:
    """Wraps a builder, keeping every tree it built."""

    def __init__(self, inner) -> None:
        self.inner, self.trees = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def build(self, *args, **kwargs) -> TokenTree:
        self.trees.append(self.inner.build(*args, **kwargs))
        return self.trees[-1]


@pytest.fixture(scope="module")
def models(tiny_pair: tuple[Path, Path], tiny_perturbed_draft: Path):
    return load_pair_models(tiny_pair, tiny_perturbed_draft)


def decode(engine: Engine, ids: list[int], constraint=None) -> list[int]:
    return [t for step in engine.generate(ids, N_NEW, constraint=constraint) for t in step]


def test_unpack_bits_reads_bit_t_of_word_t_div_32() -> None:
    words = torch.tensor([[1 - 2**31, 2]], dtype=torch.int32)      # bits 0 and 31; bit 1
    assert unpack_bits(words, 40).nonzero()[:, 1].tolist() == [0, 31, 33]


@pytest.mark.parametrize("name", builder_names())
def test_greedy_under_a_constraint_is_the_constrained_target_alone(models, name: str) -> None:
    target, draft = models["target"], models["perturbed"]
    V = target.args.vocab_size
    ids = prompt(3)
    alone = Engine(target, None, EngineConfig(budget=1), None)
    want = decode(alone, ids, toy(V))
    assert want != decode(alone, ids)                             # the constraint changes this decode
    builder = Recording(make_builder(name))
    engine = Engine(target, draft, EngineConfig(budget=16), builder)
    constraint = toy(V)
    got = decode(engine, ids, constraint)
    assert got == want, name
    context = []
    for t in got:
        assert ok(context, t)
        context.append(t)
    stats = engine.stats.summary(16, name)["grammar"]
    assert stats["target_rows"] == sum(t.tokens.numel() for t in builder.trees)
    if builder.needs_draft:                                       # masked while growing: no dead node verified
        assert stats["dead"] == 0 and stats["draft_rows"] > 0 and stats["pruned"] > 0
    assert engine.stats.generated == len(got) and len(got) / len(engine.stats.steps) > 1


def test_draft_trees_hold_only_allowed_nodes(models) -> None:
    target, draft = models["target"], models["perturbed"]
    V = target.args.vocab_size
    builder = Recording(make_builder("specexec"))
    engine = Engine(target, draft, EngineConfig(budget=32), builder)
    committed: list[int] = []
    gen = engine.generate(prompt(4), N_NEW, constraint=toy(V))
    for tree, step in zip(builder.trees, gen):                   # each tree is built before its step is yielded
        for path in tree_paths(tree)[1:]:
            assert ok(committed + list(path[:-1]), path[-1]), path
        committed += step


def test_a_rejected_path_is_dead_and_its_row_allows_everything() -> None:
    c = toy(20)
    rows = c.allowed([(), (3,), (3, 5), (1,)], 24, torch.device("cpu"))   # (3,): 3 % 3 == 0 is rejected
    assert rows.shape == (4, 24) and not rows[[0, 3], 20:].any()    # past the grammar's vocabulary: never
    assert rows[1, :20].all() and rows[2, :20].all()              # dead, and below a dead node
    assert rows[0].tolist()[:20] == [ok([], t) for t in range(20)]
    assert rows[3].tolist()[:20] == [ok([1], t) for t in range(20)]
    assert c.stats["dead"] == 2 and c.stats["target_rows"] == 4
    c.commit([1])
    assert c.allowed([()], 20, torch.device("cpu"))[0].tolist() == [ok([1], t) for t in range(20)]
    with pytest.raises(ValueError, match="rejects"):
        c.commit([1])                                             # after [1]: (1 + 1 + 1) % 3 == 0


def trips(prefix: Sequence[int], token: int) -> bool:
    """Where LimitedMatcher's library gives up: past 8 tokens, a token the rule allows with token % 5 == 0."""
    return len(prefix) >= 8 and token % 5 == 0


class LimitedMatcher(ToyMatcher):
    """ToyMatcher with a library limit: consuming a token that `trips` raises GrammarLimit (the token is
    allowed: a limit, not a rejection), standing where it stood before the call."""

    def consume(self, tokens: Sequence[int]) -> int:
        before = len(self.done)
        n = super().consume(tokens)
        for i in range(before, len(self.done)):
            if trips(self.done[:i], self.done[i]):
                del self.done[before:]
                raise GrammarLimit(f"limit at {i}")
        return n


@pytest.mark.parametrize("name", ["specexec", "chain"])
def test_a_library_limit_ends_the_generation_where_the_target_alone_meets_it(models, name: str) -> None:
    """A token the grammar allows but its library cannot take ends the text before it: the tree's limited
    paths neither fail the step nor shift the end (the target alone, cut at its first tripping token)."""
    target, draft = models["target"], models["perturbed"]
    V = target.args.vocab_size
    ids = prompt(3)
    free = decode(Engine(target, None, EngineConfig(budget=1), None), ids, toy(V))
    cut = next(i for i in range(len(free)) if trips(free[:i], free[i]))
    assert 8 <= cut < N_NEW - 1
    alone = toy(V)
    alone.matcher = LimitedMatcher(V)
    assert decode(Engine(target, None, EngineConfig(budget=1), None), ids, alone) == free[:cut]
    limited = toy(V)
    limited.matcher = LimitedMatcher(V)
    engine = Engine(target, draft, EngineConfig(budget=16), make_builder(name))
    assert decode(engine, ids, limited) == free[:cut], name
    assert limited.stats["limit"] == f"limit at {cut}" and limited.stats["dead"] == 0
