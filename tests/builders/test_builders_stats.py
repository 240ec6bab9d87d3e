"""Sampling exactness of every tree builder, checked statistically on a toy Markov target and draft
(docs/algorithms.md §18): the builder's real tree-construction code runs against a toy draft (`MarkovDraft`
implements growth.Passes on a [V, V] logits table), its trees go through the rule the engine would pick for
its declared drafting kind (and the other exact rules), and the first two emitted tokens must follow the
target's processed distribution (chi-square and TV). Negative controls show the check has teeth.

SPECEXEC_STAT_SCALE=10 runs a 10x longer check by hand.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from specexec.builders import rsd as rsd_module
from specexec.builders.chain import ChainBuilder
from specexec.builders.dynamic import DynamicBuilder
from specexec.builders.optree import OptTreeBuilder
from specexec.builders.recycling import RecyclingBuilder
from specexec.builders.rsd import RSDBuilder, RSDConstantBuilder
from specexec.builders.static import StaticBuilder
from specexec.config import SamplingParams
from specexec.sampling import make_generator, process_logits, sample
from specexec.tree import TokenTree
from specexec.acceptance.rules import RULES, accept_greedy, default_rule, exact_rules_for
from tests.sampling.chi2 import chi2_pvalue

V, ROOT, BUDGET = 10, 3, 6
BUDGETS = {"chain": 3}              # a chain's first two tokens only need depth 3
SCALE = float(os.environ.get("SPECEXEC_STAT_SCALE", "1"))
TRIALS = int(2000 * SCALE)


class MarkovPasses:
    """growth.Passes on a toy draft whose next-token logits depend on the current token only."""

    L0 = 0

    def __init__(self, logits: torch.Tensor, capacity: int, sampling: SamplingParams) -> None:
        self.logits, self.capacity, self.sampling, self.n_proc = logits, capacity, sampling, 0

    def root(self, root_token: int) -> torch.Tensor:
        self.n_proc = 1
        return process_logits(self.logits[root_token][None], self.sampling)

    def expand(self, tokens: torch.Tensor, depths: torch.Tensor, parent_proc: torch.Tensor,
               proc: torch.Tensor | None = None) -> torch.Tensor:
        assert bool((parent_proc >= 0).all()) and bool((parent_proc < self.capacity).all())
        self.n_proc += tokens.numel()
        if proc is None:
            assert self.n_proc <= self.capacity, f"{self.n_proc} processed nodes > capacity {self.capacity}"
        else:
            assert bool((proc > 0).all()) and bool((proc < self.capacity).all())
        return process_logits(self.logits[tokens], self.sampling)

    def slots(self, proc: torch.Tensor) -> torch.Tensor:
        return proc.clone()


class MarkovDraft:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def passes(self, capacity: int, sampling: SamplingParams) -> MarkovPasses:
        return MarkovPasses(self.logits, capacity, sampling)


def toy_logits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logits tables [V, V] (row = current token); the draft is a noisy target."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(V, V, generator=g) * 2
    return p, p + torch.randn(V, V, generator=g) * 1.5


BUILDERS = {
    "chain": ChainBuilder, "static": lambda: StaticBuilder(max_depth=3), "dynamic": DynamicBuilder,
    "optree": lambda: OptTreeBuilder(threshold=0.0), "rsd": RSDBuilder, "rsd-c": RSDConstantBuilder,
    "recycling": RecyclingBuilder,
}


def same_tree(a: TokenTree, b: TokenTree) -> bool:
    return all(torch.equal(x, y) for x, y in ((a.tokens, b.tokens), (a.parents, b.parents), (a.scores, b.scores)))


def fixed_tree(builder, draft, budget: int, sampling: SamplingParams) -> TokenTree | None:
    """A model-based deterministic builder's tree is a function of the context: check it (two generators),
    then verify that one tree in every trial. None for builders whose trees are random or learn."""
    if builder.drafting != "deterministic" or not builder.needs_draft:
        return None
    tree = builder.build(draft, ROOT, budget, sampling, make_generator(123))
    assert same_tree(tree, builder.build(draft, ROOT, budget, sampling, make_generator(456)))
    return tree


@torch.inference_mode()              # as the engine runs builders and verification
def emitted_pairs(builder, p_logits: torch.Tensor, q_logits: torch.Tensor, sampling: SamplingParams,
                  rule_name: str, trials: int, seed: int = 0) -> torch.Tensor:
    """Counts [V, V] of the first two tokens emitted from ROOT (the second drawn from p when a step emitted
    only one: that is what the next step would emit)."""
    gen = make_generator(seed)
    logp = process_logits(p_logits, sampling)
    p = logp.exp()
    rule = RULES[rule_name]
    draft = MarkovDraft(q_logits) if builder.needs_draft else None
    if getattr(builder, "observe_topk", 0):
        builder.bind(V, "cpu")
    budget = BUDGETS.get(builder.name, BUDGET)
    fixed = fixed_tree(builder, draft, budget, sampling)
    firsts, seconds = [], []
    for _ in range(trials):
        tree = fixed or builder.build(draft, ROOT, budget, sampling, gen)
        assert tree.size <= budget and int(tree.tokens[0]) == ROOT
        toks = tree.tokens.tolist()
        if rule.target == "sample":
            out = accept_greedy(tree, sample(logp[tree.tokens], gen)).tokens
        else:
            extra = (lambda n: builder.draft_probs(tree, n),) if rule.needs_draft else ()
            out = rule.fn(tree, lambda n: p[toks[n]], *extra, gen).tokens
        if getattr(builder, "observe_topk", 0):
            builder.observe_target(tree, p_logits[tree.tokens].topk(builder.observe_topk, dim=-1).indices)
        firsts.append(out[0])
        seconds.append(out[1] if len(out) > 1 else -1)
    a, b = torch.tensor(firsts), torch.tensor(seconds)
    missing = b < 0
    b[missing] = sample(logp[a[missing]], gen)
    return torch.bincount(a * V + b, minlength=V * V).reshape(V, V).double()


def check(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, float, float]:
    """(first-token TV, first-token p-value, joint p-value) against the exact target marginals."""
    n = float(counts.sum())
    tv = 0.5 * float((counts.sum(1) / n - p[ROOT]).abs().sum())
    return tv, chi2_pvalue(counts.sum(1), p[ROOT]), chi2_pvalue(counts, p[ROOT][:, None] * p)


def assert_exact(counts: torch.Tensor, p: torch.Tensor) -> None:
    tv, p_first, p_joint = check(counts, p)
    assert tv < 4 / math.sqrt(float(counts.sum())), f"first-token TV {tv:.4f}"
    assert p_first > 1e-3 and p_joint > 1e-3, f"chi-square p-values {p_first:.2e}, {p_joint:.2e}"


CASES = [(name, t) for name in BUILDERS for t in (0.6, 1.0)]


@pytest.mark.slow
@pytest.mark.parametrize("name,temperature", CASES)
def test_builder_keeps_the_target_distribution(name: str, temperature: float) -> None:
    """The engine's default rule for the builder's drafting kind, at T = 0.6 and 1.0."""
    builder = BUILDERS[name]()
    sampling = SamplingParams(temperature=temperature)
    p_logits, q_logits = toy_logits(1)
    rule = default_rule(builder.drafting, sampling)
    counts = emitted_pairs(builder, p_logits, q_logits, sampling, rule, TRIALS)
    assert_exact(counts, process_logits(p_logits, sampling).exp())


OTHER_RULES = [(name, rule) for name in BUILDERS for rule in exact_rules_for(BUILDERS[name]().drafting,
               SamplingParams(temperature=1.0)) if rule != default_rule(BUILDERS[name]().drafting,
                                                                        SamplingParams(temperature=1.0))]


@pytest.mark.parametrize("name,rule", OTHER_RULES)
def test_builder_with_its_other_exact_rule(name: str, rule: str) -> None:
    """Every other rule the engine accepts for the builder (T = 1, top-p 0.9: truncated supports)."""
    sampling = SamplingParams(temperature=1.0, top_p=0.9)
    p_logits, q_logits = toy_logits(2)
    counts = emitted_pairs(BUILDERS[name](), p_logits, q_logits, sampling, rule, TRIALS // 2, seed=1)
    assert_exact(counts, process_logits(p_logits, sampling).exp())


@pytest.mark.parametrize("name", ["chain", "rsd", "dynamic"])
def test_trimmed_draft_vocabulary_keeps_the_target_distribution(name: str) -> None:
    """VocabTrim: a draft that never proposes half the vocabulary (q = 0 there) changes nothing."""
    sampling = SamplingParams(temperature=1.0)
    p_logits, q_logits = toy_logits(3)
    q_logits = q_logits.index_fill(1, torch.arange(0, V, 2), float("-inf"))
    builder = BUILDERS[name]()
    counts = emitted_pairs(builder, p_logits, q_logits, sampling, default_rule(builder.drafting, sampling),
                           TRIALS // 2, seed=2)
    assert_exact(counts, process_logits(p_logits, sampling).exp())


def test_negative_control_rsd_without_gumbel_noise_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """RSD-S with deterministic beams at T > 0 (children no longer drawn from q) is biased under rrs_wor."""
    def no_noise(logq: torch.Tensor, k: int, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
        top = logq.topk(k, dim=-1)
        return top.indices, top.values
    monkeypatch.setattr(rsd_module, "gumbel_topk", no_noise)
    sampling = SamplingParams(temperature=1.0)
    p_logits, q_logits = toy_logits(1)
    counts = emitted_pairs(RSDBuilder(), p_logits, q_logits, sampling, "rrs_wor", TRIALS)
    tv, p_first, p_joint = check(counts, process_logits(p_logits, sampling).exp())
    assert min(p_first, p_joint) < 1e-6, f"biased tree not detected: p-values {p_first:.2e}, {p_joint:.2e}"


@pytest.mark.slow
def test_negative_control_wrong_draft_probs_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain verified against a q other than the one it was drawn from (pitfall 2) is biased."""
    builder = ChainBuilder()
    real = builder.draft_probs
    monkeypatch.setattr(builder, "draft_probs", lambda tree, node: torch.softmax(real(tree, node).log() / 2, -1))
    sampling = SamplingParams(temperature=1.0)
    p_logits, q_logits = toy_logits(1)
    counts = emitted_pairs(builder, p_logits, q_logits, sampling, "rrs_wor", TRIALS)
    tv, p_first, p_joint = check(counts, process_logits(p_logits, sampling).exp())
    assert min(p_first, p_joint) < 1e-6, f"biased verifier not detected: p-values {p_first:.2e}, {p_joint:.2e}"


def test_markov_tree_is_what_the_builder_would_grow_on_a_model() -> None:
    """Sanity of the harness: toy trees are budgeted, topological, with distinct siblings."""
    p_logits, q_logits = toy_logits(0)
    for name, make in BUILDERS.items():
        builder = make()
        if getattr(builder, "observe_topk", 0):
            builder.bind(V, "cpu")
            builder.observe_target(TokenTree.root_only(ROOT), p_logits[[ROOT]].topk(builder.k).indices)
        draft = MarkovDraft(q_logits) if builder.needs_draft else None
        for t in (0.0, 1.0):
            tree = builder.build(draft, ROOT, BUDGET, SamplingParams(temperature=t), make_generator(0))
            assert 1 <= tree.size <= BUDGET, name
            parents = tree.parents.tolist()
            assert parents[0] == -1 and all(0 <= q < i for i, q in enumerate(parents) if i), name
            for u in range(tree.size + 1):
                kids = tree.tokens[tree.parents == u].tolist()
                assert len(kids) == len(set(kids)), f"{name}: repeated sibling tokens {kids}"
