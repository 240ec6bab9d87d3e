"""The tree-builder family on tiny models (fp32): greedy exactness for every builder whatever the draft,
tree invariants, draft-cache reuse (scores and draft_probs equal a fresh, cache-free draft pass), exact-rule
selection, Sequoia's DP against brute force, Token Recycling without a draft model, VocabTrim, and the
registry/CLI wiring. Sampling exactness is in test_builders_stats.py.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch

from cli.main import main
from specexec.builders.recycling import RecyclingBuilder
from specexec.builders.rsd import RSDBuilder, branching_shape, shift_gumbel
from specexec.builders.static import StaticBuilder, tree_shape
from specexec.config import EngineConfig, SamplingParams
from specexec.decoding.engine import Engine
from specexec.options import ConfigError
from specexec.builders.registry import builder_needs_draft, make_builder, names as builder_names
from specexec.runtime.assembly import Runtime
from specexec.sampling import process_logits
from specexec.tree import TokenTree
from tests.tiny_models import load_pair_models, prompt
from specexec.tuning import acceptance
from specexec.tuning.vocab_trim import TrimmedDraft, auto_size, counts_from_tokens, select_vocab

NEW_BUILDERS = [name for name in builder_names() if name != "specexec"]
N_NEW = 32


@pytest.fixture(scope="module")
def models(tiny_pair: tuple[Path, Path], tiny_perturbed_draft: Path):
    return load_pair_models(tiny_pair, tiny_perturbed_draft)


@functools.lru_cache(maxsize=None)
def _target_only(model_id: int, ids: tuple[int, ...], n_new: int) -> tuple[int, ...]:
    engine = Engine(_MODELS[model_id], None, EngineConfig(budget=1), None)
    return tuple(t for s in engine.generate(list(ids), n_new) for t in s)


_MODELS: dict[int, torch.nn.Module] = {}


def target_only(target, ids: list[int], n_new: int = N_NEW) -> list[int]:
    _MODELS[id(target)] = target
    return list(_target_only(id(target), tuple(ids), n_new))


class Checked:
    """Wraps a builder: checks every tree's invariants and keeps the trees (delegates everything else)."""

    def __init__(self, builder) -> None:
        self.inner, self.trees = builder, []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def build(self, draft, root_token: int, budget: int, sampling: SamplingParams, rng=None) -> TokenTree:
        tree = self.inner.build(draft, root_token, budget, sampling, rng)
        assert tree.size <= budget and int(tree.tokens[0]) == root_token
        parents = tree.parents.tolist()
        assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
        assert torch.equal(tree.depths[1:], tree.depths[tree.parents[1:]] + 1)
        for u in set(parents[1:]):
            kids = tree.tokens[tree.parents == u].tolist()
            assert len(kids) == len(set(kids)), f"{self.inner.name}: repeated siblings {kids}"
        if tree.draft_slots is not None:                      # processed nodes form an ancestor-closed set
            done = (tree.draft_slots >= 0).tolist()
            assert done[0] and all(done[p] for i, p in enumerate(parents) if i and done[i])
        self.trees.append(tree)
        return tree


def run(target, draft, name: str, budget: int, ids: list[int], n_new: int = N_NEW,
        sampling: SamplingParams = SamplingParams(), builder=None) -> tuple[list[int], Engine]:
    builder = Checked(builder or make_builder(name))
    engine = Engine(target, draft if builder.needs_draft else None, EngineConfig(budget=budget, builder=name),
                    builder)
    return [t for step in engine.generate(ids, n_new, sampling) for t in step], engine


# ------------------------------------------------------------------------------------------ greedy exactness

@pytest.mark.parametrize("name", NEW_BUILDERS)
def test_greedy_output_equals_target_only_decode(models, name: str) -> None:
    ids = prompt(0)
    want = target_only(models["target"], ids)
    drafts = ("perturbed", "random") if builder_needs_draft(name) else ("none",)
    for draft_name in drafts:
        for budget in (1, 3, 12) if name == "chain" else (1, 3, 12, 40):     # a chain: one pass per token
            got, engine = run(models["target"], models.get(draft_name), name, budget, ids)
            assert got == want, f"{name} draft={draft_name} budget={budget}"
            assert all(s.tree_size <= budget for s in engine.stats.steps)


@pytest.mark.parametrize("name", ["chain", "static", "dynamic", "optree", "rsd", "rsd-c"])
def test_self_draft_accepts_more_than_one_token_per_step(models, name: str) -> None:
    ids = prompt(1)
    got, engine = run(models["target"], models["target"], name, 16, ids, 48)
    assert got == target_only(models["target"], ids, 48)
    assert engine.stats.summary(16, name)["tokens_per_step"] > 2.5


def test_self_drafted_chain_is_accepted_whole(models) -> None:
    """draft == target: every chain token is the target's argmax, so each step emits budget + 1 tokens."""
    got, engine = run(models["target"], models["target"], "chain", 5, prompt(2), 36)
    assert [s.accepted for s in engine.stats.steps] == [6] * 6


def test_a_catch_up_pass_runs_the_draft_head_on_its_last_row_only(models, monkeypatch) -> None:
    """The root pass feeds the pending tokens (accepted ones, then the root) but only the root's distribution is
    read: the LM head, a large share of a small draft's pass, runs on that one row."""
    draft = models["perturbed"]
    seen, head = [], draft.logits
    monkeypatch.setattr(draft, "logits", lambda hidden, rows=None: (seen.append(hidden.shape[-2]), head(hidden))[1])
    fed, forward = [], draft.forward
    monkeypatch.setattr(draft, "forward", lambda tokens, *a, **k: (fed.append(tokens.shape[1]), forward(tokens, *a,
                                                                                                        **k))[1])
    ids = prompt(3)
    got, engine = run(models["target"], draft, "specexec", 1, ids, 24)
    assert got == target_only(models["target"], ids, 24)
    assert max(fed[1:]) > 1                                  # catch-up passes of several tokens ...
    assert seen == [1] * (len(fed) - 1)                      # ... one head row each (the prompt's prefill: none)


# ------------------------------------------------------------------------------- draft-cache reuse

@torch.inference_mode()
def fresh_logq(draft, context: list[int], path_tokens: list[int], sampling: SamplingParams) -> torch.Tensor:
    """Processed draft log-probs [len(path_tokens), V] after each token of the tree path `path_tokens`
    (root first; the root is context[-1]), computed over context[:-1] + path with no cache."""
    seq = torch.tensor(context[:-1] + path_tokens)
    logits = draft.logits(draft(seq[None], torch.arange(seq.numel())[None]))
    return process_logits(logits[len(context) - 1:], sampling)


@pytest.mark.parametrize("name", ["chain", "static", "dynamic", "optree", "rsd", "rsd-c"])
def test_scores_are_cumulative_draft_logprobs_after_several_steps(models, name: str) -> None:
    """With the draft KV reused across nodes and steps, every node's score is still the cumulative draft
    log-prob of its path recomputed from scratch (positions, masks and slots are right)."""
    draft, ids = models["perturbed"], prompt(3)
    _, engine = run(models["target"], draft, name, 12, ids, 20)
    tree = engine.builder.trees[-1]
    done = len(ids) + sum(s.accepted for s in engine.stats.steps[:-1])
    context = (ids + target_only(models["target"], ids, 20))[:done]      # greedy: emitted == target-only
    assert int(tree.tokens[0]) == context[-1]
    for node in range(1, tree.size + 1):
        path = tree.path(node)
        logq = fresh_logq(draft, context, tree.tokens[path].tolist(), SamplingParams())
        want = sum(float(logq[i, int(tree.tokens[n])]) for i, n in enumerate(path[1:]))
        assert abs(float(tree.scores[node]) - want) < 1e-3, (name, node)


class KeepDraftProbs:
    """Records, right after each build, the builder's draft_probs at every node with children."""

    def __init__(self, builder) -> None:
        self.inner, self.records = builder, []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def build(self, draft, root_token, budget, sampling, rng=None):
        tree = self.inner.build(draft, root_token, budget, sampling, rng)
        inner = sorted(set(tree.parents[1:].tolist()))
        self.records.append((tree, {u: self.inner.draft_probs(tree, u) for u in inner}))
        return tree


@pytest.mark.parametrize("name", ["chain", "static", "rsd", "rsd-c"])
def test_draft_probs_are_the_distribution_the_children_were_drawn_from(models, name: str) -> None:
    """rrs_wor divides by q: draft_probs(tree, node) must equal a fresh draft pass over the node's path."""
    draft, ids = models["perturbed"], prompt(4)
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    builder = KeepDraftProbs(make_builder(name))
    engine = Engine(models["target"], draft, EngineConfig(budget=10, builder=name), builder)
    emitted = [t for s in engine.generate(ids, 16, sampling) for t in s]
    steps = engine.stats.steps
    done = len(ids)
    context_all = ids + emitted
    for (tree, probs), step in zip(builder.records, steps):
        context = context_all[:done]
        for u, q in probs.items():
            path = tree.tokens[tree.path(u)].tolist()
            want = fresh_logq(draft, context, path, sampling)[-1].exp()
            # 1e-4: the tree pass attends prefix and tree apart (log-sum-exp merge), the fresh pass in one softmax
            assert torch.allclose(q, want, atol=1e-4), (name, u, (q - want).abs().max())
        done += step.accepted


# --------------------------------------------------------------------------------------- exact rules

@pytest.mark.parametrize("name,verifier", [("chain", "rrs"), ("rsd", "rrs"), ("static", "rrs"),
                                           ("dynamic", "rrs_wor"), ("recycling", "rrs_wor")])
def test_a_verifier_that_is_not_exact_for_the_builder_is_refused(models, name: str, verifier: str) -> None:
    builder = make_builder(name)
    draft = models["perturbed"] if builder.needs_draft else None
    engine = Engine(models["target"], draft, EngineConfig(builder=name, verifier=verifier), builder)
    with pytest.raises(ConfigError, match="not exact"):
        next(engine.generate(prompt(5), 4, SamplingParams(temperature=0.7)))


def test_declared_drafting_kinds() -> None:
    kinds = {name: make_builder(name).drafting for name in builder_names()}
    assert kinds == {"specexec": "deterministic", "chain": "without_replacement", "static": "without_replacement",
                     "dynamic": "deterministic", "optree": "deterministic", "rsd": "without_replacement",
                     "rsd-c": "without_replacement", "recycling": "deterministic"}
    for name in builder_names():
        b = make_builder(name)
        assert b.name == name and (b.drafting == "deterministic" or callable(getattr(b, "draft_probs", None)))
    assert not builder_needs_draft("recycling") and all(builder_needs_draft(n) for n in NEW_BUILDERS
                                                        if n != "recycling")


@pytest.mark.parametrize("name", ["chain", "rsd", "static"])
def test_sampled_builders_run_end_to_end_with_their_default_rule(models, name: str) -> None:
    sampling = SamplingParams(temperature=1.0, seed=3)
    got, engine = run(models["target"], models["perturbed"], name, 8, prompt(6), 24, sampling)
    assert len(got) == 24 and engine.stats.summary(8, name)["tokens_per_step"] > 1.2


# ------------------------------------------------------------------------------------- Sequoia's DP

def brute_force(n: int, depth: int, acc: tuple[float, ...]) -> float:
    """Best sum of path values over trees with exactly n nodes (root included), depth <= depth."""
    @functools.lru_cache(maxsize=None)
    def best(size: int, d: int) -> float:
        if size == 1:
            return 1.0
        if d == 0:
            return -math.inf
        return 1.0 + children(size - 1, d - 1, 0)

    @functools.lru_cache(maxsize=None)
    def children(left: int, d: int, rank: int) -> float:
        if left == 0:
            return 0.0
        if rank == len(acc):
            return -math.inf
        return max(acc[rank] * best(y, d) + children(left - y, d, rank + 1) for y in range(1, left + 1))
    return best(n, depth)


@pytest.mark.parametrize("budget,depth", [(1, 1), (4, 2), (6, 3), (9, 4), (12, 2)])
def test_dp_shape_is_optimal(budget: int, depth: int) -> None:
    acc = (0.5, 0.2, 0.1)
    shape = tree_shape(budget, depth, acc)
    want = max(brute_force(m, depth, acc) for m in range(1, budget + 2))
    assert shape.size <= budget and max(shape.depths) <= depth
    assert max(shape.count) <= len(acc)
    assert abs(shape.expected_tokens() - want) < 1e-5


def test_dp_shape_grows_with_budget_and_handles_large_budgets() -> None:
    values = [tree_shape(b, 12).expected_tokens() for b in (1, 8, 64, 256)]
    assert values == sorted(values) and values[0] == pytest.approx(1.6)
    big = tree_shape(1024, 16)
    assert big.size == 1024 and 10 <= max(big.depths) <= 16


def test_acceptance_vector_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "acc.json"
    acceptance.save(path, 0.6, [0.7, 0.1, 0.05], pair="tiny")
    assert acceptance.load_table(path) == {0.6: (0.7, 0.1, 0.05)}
    assert StaticBuilder(acceptance_file=str(path)).shape_for(6).size == 6
    path.write_text(json.dumps({"vectors": {"0.6": {"acceptance": [0.9, 0.5]}}}))
    with pytest.raises(ConfigError, match="summing to at most 1"):
        acceptance.load_table(path)


def test_rsd_c_shape_and_rsd_s_beam() -> None:
    shape = branching_shape(10, (2, 2, 2))
    assert shape.size == 10 and shape.count[:3] == (2, 2, 2) and max(shape.depths) == 3
    assert RSDBuilder().beam(16) == (4, 4) and RSDBuilder().beam(1) == (1, 1)
    assert all(w * l <= b for b in (1, 2, 7, 64, 1000) for w, l in [RSDBuilder().beam(b)])


def test_gumbel_shift_conditions_children_on_the_parent_value() -> None:
    """Kool et al.: the children's conditioned values have maximum exactly G(parent) and keep their order."""
    g = torch.Generator().manual_seed(0)
    child = torch.randn(5, 7, generator=g, dtype=torch.float64) * 3
    child[0, 3:] = -math.inf
    parent = torch.randn(5, 1, generator=g, dtype=torch.float64) - 4
    shifted = shift_gumbel(child, parent, child.max(dim=1, keepdim=True).values)
    assert torch.allclose(shifted.max(dim=1).values, parent[:, 0])
    assert torch.equal(shifted.argsort(dim=1), child.argsort(dim=1))
    assert bool(torch.isneginf(shifted[0, 3:]).all())


# ----------------------------------------------------------------------------------- Token Recycling

def test_recycling_needs_no_draft_and_learns_from_the_target(models) -> None:
    target, ids = models["target"], prompt(7)
    builder = Checked(RecyclingBuilder())
    engine = Engine(target, None, EngineConfig(budget=40, builder="recycling"), builder)
    first = [t for s in engine.generate(ids, 40) for t in s]
    assert first == target_only(target, ids, 40)
    cold = engine.stats.summary(40, "recycling")["tokens_per_step"]
    again = [t for s in engine.generate(ids, 40) for t in s]     # hot start: the matrix is kept
    assert again == first
    assert engine.stats.summary(40, "recycling")["tokens_per_step"] > max(cold, 1.3)
    assert all(t.draft_slots is None for t in builder.trees)


def test_recycling_with_a_draft_given_ignores_it(models) -> None:
    engine = Engine(models["target"], models["perturbed"], EngineConfig(budget=8, builder="recycling"),
                    RecyclingBuilder())
    ids = prompt(8)
    assert [t for s in engine.generate(ids, 12) for t in s] == target_only(models["target"], ids, 12)
    assert engine._caches[1] is None                              # no draft cache was allocated


def test_recycling_template_matches_the_paper_scale() -> None:
    shape = RecyclingBuilder().template(80)
    assert shape.size == 80 and max(shape.depths) == 6 and max(shape.count) <= 8


def test_runtime_and_cli_run_recycling_with_no_draft(capsys, tiny_pair) -> None:
    target, _ = tiny_pair
    runtime = Runtime.load(str(target), None, EngineConfig(builder="recycling", budget=16))
    assert runtime.builder_name == "recycling"
    code = main(["generate", "--model", str(target), "--builder", "recycling", "--no-draft", "--prompt",
                 "Hello there", "--max-new-tokens", "10", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    obj = json.loads(out.out)
    assert obj["stats"]["builder"] == "recycling" and len(obj["token_ids"]) == 10
    code = main(["generate", "--model", str(target), "--no-draft", "--prompt", "Hello there",
                 "--max-new-tokens", "10", "--json"])
    assert json.loads(capsys.readouterr().out)["token_ids"] == obj["token_ids"]


# ------------------------------------------------------------------------------------------ VocabTrim

def test_vocab_selection() -> None:
    counts = counts_from_tokens([5, 5, 5, 2, 2, 9, 7, 7], 12)
    assert select_vocab(counts, 3).tolist() == [2, 5, 7]
    assert select_vocab(counts, 3, always=(11,)).tolist() == [2, 5, 7, 11]
    assert select_vocab(counts, 5).tolist() == [0, 2, 5, 7, 9]        # ties: lower ids first
    assert auto_size(counts) == 12                                     # capped at the vocabulary
    assert auto_size(torch.zeros(50_000).index_fill(0, torch.arange(3000), 1.0)) == 16384


def test_trimmed_draft_scores_only_the_kept_tokens(models) -> None:
    draft = models["perturbed"]
    keep = torch.tensor([3, 17, 40, 41, 200])
    trimmed = TrimmedDraft(draft, keep)
    h = torch.randn(4, draft.args.dim)
    full, small = draft.logits(h), trimmed.logits(h)
    assert small.shape == full.shape and trimmed.n_kept == 5
    assert torch.allclose(small[:, keep], full[:, keep], atol=1e-5)
    mask = torch.ones(full.shape[1], dtype=torch.bool)
    mask[keep] = False
    assert bool(torch.isneginf(small[:, mask]).all())


def test_a_quantized_head_stays_quantized_over_the_kept_rows(models) -> None:
    """An int8 head (--draft-quant on a CPU) is trimmed to an int8 head of N rows: its bytes shrink by V/N and
    the kept scores are the full quantized head's up to the requantization of those rows."""
    import copy
    from offload.quant.linear import QuantLinear
    from specexec.runtime.offloaded import quantize_head
    draft = copy.deepcopy(models["perturbed"])
    quantize_head(draft, "int4")
    assert isinstance(draft.lm_head, QuantLinear)
    keep = torch.tensor([3, 17, 40, 41, 200])
    trimmed = TrimmedDraft(draft, keep)
    assert trimmed.head is not None and trimmed.weight is None and trimmed.head.fmt == "int8"
    assert trimmed.head.qdata.shape == (5, draft.args.dim)
    h = torch.randn(4, draft.args.dim)
    full, small = draft.logits(h), trimmed.logits(h)
    assert torch.allclose(small[:, keep], full[:, keep], rtol=0.02, atol=0.02)
    assert bool(torch.isneginf(small[:, [0, 1, 2, 4]]).all())


@pytest.mark.parametrize("name", ["specexec", "dynamic", "rsd", "chain"])
def test_trimmed_draft_keeps_greedy_exactness_and_never_drafts_outside_the_set(models, name: str) -> None:
    target, ids = models["target"], prompt(9)
    want = target_only(target, ids)
    keep = select_vocab(counts_from_tokens(want[: N_NEW // 2], target.args.vocab_size), 24)
    got, engine = run(target, TrimmedDraft(models["perturbed"], keep), name, 12, ids)
    assert got == want
    drafted = torch.cat([t.tokens[1:] for t in engine.builder.trees])
    assert bool(torch.isin(drafted, keep).all())


def test_runtime_draft_vocab_measures_once_then_uses_the_cache(monkeypatch, tmp_path, tiny_pair,
                                                               tiny_perturbed_draft) -> None:
    import specexec.runtime.assembly as runtime_module
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path))
    monkeypatch.setattr(runtime_module, "VOCAB_CALIBRATION_TOKENS", 3)
    target, _ = tiny_pair
    config = EngineConfig(budget=8, draft_vocab=64)
    rt = Runtime.load(str(target), str(tiny_perturbed_draft), config)
    assert isinstance(rt.engine.draft, TrimmedDraft) and rt.engine.draft.n_kept >= 64
    assert "head: " in rt.draft_info.dtype and list((tmp_path / "vocab").glob("*.json"))
    monkeypatch.setattr(runtime_module, "measure_counts", lambda *a: pytest.fail("the cache was not used"))
    rt = Runtime.load(str(target), str(tiny_perturbed_draft), config.replace(draft_vocab="auto"))
    ids = prompt(10)
    assert [t for s in rt.generate_ids(ids, 12) for t in s] == target_only(rt.engine.target, ids, 12)
    with pytest.raises(ConfigError, match="draft-vocab"):
        Runtime.load(str(target), str(tiny_perturbed_draft), config.replace(draft_vocab=10**6))


def test_cli_rejects_a_bad_draft_vocab(capsys, tiny_pair) -> None:
    target, draft = tiny_pair
    code = main(["generate", "--model", str(target), "--draft", str(draft), "--prompt", "hi", "--draft-vocab",
                 "lots"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "--draft-vocab" in err


def test_builder_options_reach_the_builder_but_not_its_drafting_kind(tmp_path: Path) -> None:
    path = tmp_path / "acc.json"
    acceptance.save(path, 0.0, [0.8, 0.1])
    builder = make_builder("static", (("acceptance_file", str(path)), ("max_depth", 4)))
    assert builder.vector_for(0.0) == (0.8, 0.1) and builder.max_depth == 4
    with pytest.raises(ConfigError, match="cannot be set"):
        make_builder("rsd", (("drafting", "deterministic"),))
    with pytest.raises(ConfigError, match="does not take"):
        make_builder("chain", (("width", 3),))
