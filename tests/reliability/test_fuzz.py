"""Property-based fuzzing (hypothesis) of the pure pieces every step relies on: TokenTree (ancestor mask,
positions, select/prune), KVCache.keep (commit the accepted path) and the acceptance rules of verify.RULES on
random trees and random draft/target distributions (zeros, one-hot rows, a vocabulary of 1, near-uniform,
logits of +-1e4, draft and target with disjoint supports).

Each property is checked against a reference built by hand from parents lists (no vectorised code), and the
examples are sized so the whole file runs in a few seconds. The tests run without a database (nothing is
written to .hypothesis/) and print the failing example's reproduction blob.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("hypothesis")                  # the test extra's; a machine without it skips this file

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specexec.config import SamplingParams  # noqa: E402
from specexec.kv.cache import KVCache  # noqa: E402
from specexec.sampling import process_logits  # noqa: E402
from specexec.tree import TokenTree  # noqa: E402
from specexec.acceptance.rules import RULES, Accepted  # noqa: E402

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=60, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------ strategies

@st.composite
def parents_lists(draw, max_nodes: int = 24) -> list[int]:
    """parents[0] = -1, parents[i] in [0, i): any rooted tree in topological order (chains, stars, bushes)."""
    n = draw(st.integers(1, max_nodes))
    shape = draw(st.sampled_from(["random", "chain", "star", "recent"]))
    parents = [-1]
    for i in range(1, n):
        if shape == "chain":
            parents.append(i - 1)
        elif shape == "star":
            parents.append(0)
        elif shape == "recent":                      # deep and bushy: a parent among the last few nodes
            parents.append(draw(st.integers(max(0, i - 3), i - 1)))
        else:
            parents.append(draw(st.integers(0, i - 1)))
    return parents


@st.composite
def trees(draw, max_nodes: int = 24, vocab: int = 50) -> TokenTree:
    """A TokenTree whose scores never increase along a path (cumulative log-probs; ties allowed)."""
    parents = draw(parents_lists(max_nodes))
    tokens = [draw(st.integers(0, vocab - 1)) for _ in parents]
    scores = [0.0]
    for p in parents[1:]:
        step = draw(st.sampled_from([0.0, -0.5, -1.0]) | st.floats(-8.0, 0.0, allow_nan=False))
        scores.append(scores[p] + step)
    return TokenTree.from_lists(tokens, parents, scores)


def ancestors(parents: list[int], i: int) -> list[int]:
    """i and every ancestor of i, root last (the reference, by walking the list)."""
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out


# ------------------------------------------------------------------------------------------ TokenTree

@FUZZ
@given(tree=trees(), prefix=st.integers(0, 10_000))
def test_mask_positions_paths(tree: TokenTree, prefix: int) -> None:
    parents = tree.parents.tolist()
    n = len(parents)
    mask = tree.ancestor_mask()
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    for i in range(n):
        seen = set(torch.nonzero(mask[i]).flatten().tolist())
        assert seen == set(ancestors(parents, i)), f"node {i} must see exactly itself and its ancestors"
        assert tree.path(i) == ancestors(parents, i)[::-1]
        assert tree.children(i) == [c for c in range(n) if parents[c] == i]
    depths = [len(ancestors(parents, i)) - 1 for i in range(n)]
    assert tree.depths.tolist() == depths
    assert tree.positions(prefix).tolist() == [prefix + d for d in depths]
    assert bool((mask.tril() == mask).all()), "parents precede children, so the mask is lower-triangular"


def _check_subtree(sub: TokenTree, tree: TokenTree, keep: list[int]) -> None:
    """`sub` is `tree` restricted to the original nodes `keep` (ascending), connected, parents remapped."""
    parents = tree.parents.tolist()
    new_parents = sub.parents.tolist()
    assert keep[0] == 0 and new_parents[0] == -1
    for j, k in enumerate(keep[1:], start=1):
        assert parents[k] in keep, f"kept node {k} lost its parent {parents[k]}"
        assert 0 <= new_parents[j] < j and keep[new_parents[j]] == parents[k]
    assert sub.tokens.tolist() == [tree.tokens[k].item() for k in keep]
    assert sub.depths.tolist() == [tree.depths[k].item() for k in keep]
    assert sub.scores.tolist() == [tree.scores[k].item() for k in keep]
    # the sub-tree's own bookkeeping agrees with its parents (depth = parent depth + 1)
    assert all(sub.depths[j] == sub.depths[new_parents[j]] + 1 for j in range(1, len(keep)))


@FUZZ
@given(tree=trees(), budget=st.integers(0, 30))
def test_prune_keeps_the_best_connected(tree: TokenTree, budget: int) -> None:
    pruned = tree.prune(budget)
    scores = tree.scores.tolist()
    n = len(scores)
    best = sorted(range(1, n), key=lambda i: (-scores[i], i))[:budget]       # ties: earlier nodes
    keep = [0] + sorted(best)
    assert pruned.size == min(tree.size, budget)
    _check_subtree(pruned, tree, keep)


@FUZZ
@given(tree=trees(), picks=st.lists(st.integers(0, 10_000), max_size=8))
def test_select_any_ancestor_closed_set(tree: TokenTree, picks: list[int]) -> None:
    parents = tree.parents.tolist()
    n = len(parents)
    keep = sorted({a for p in picks for a in ancestors(parents, p % n)} | {0})
    _check_subtree(tree.select(torch.tensor(keep)), tree, keep)
    leaves = [i for i in range(1, n) if parents[i] > 0]                        # a node whose parent is not root
    if leaves:
        with pytest.raises(ValueError, match="ancestor-closed"):
            tree.select(torch.tensor([0, leaves[-1]]))


@FUZZ
@given(parents=st.lists(st.integers(-3, 30), min_size=1, max_size=12))
def test_from_lists_rejects_what_is_not_a_tree(parents: list[int]) -> None:
    valid = parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
    if valid:
        assert TokenTree.from_lists([0] * len(parents), parents).size == len(parents) - 1
    else:
        with pytest.raises(ValueError):
            TokenTree.from_lists([0] * len(parents), parents)


# ------------------------------------------------------------------------------------------ KVCache.keep

@FUZZ
@given(prefix=st.integers(0, 6), steps=st.lists(st.tuples(parents_lists(10), st.integers(0, 10_000)),
                                                  min_size=1, max_size=4))
def test_kv_keep_commits_exactly_the_accepted_path(prefix: int, steps: list) -> None:
    """Like Engine._step: the tree's node i is written at slot length + i, then keep(length + path) commits
    the accepted root path, in order, after the untouched prefix. Every row is tagged with a unique value."""
    layers, heads, dim = 2, 2, 3
    capacity = prefix + sum(len(p) for p, _ in steps)
    cache = KVCache(layers, heads, dim, capacity, torch.float32, "cpu")
    committed: list[float] = []                        # reference: the tag of every committed row, in order

    def tag(step: int, node: int) -> float:
        return float(1000 * step + node + 1)

    def rows(tags: list[float], layer: int, sign: float) -> torch.Tensor:
        t = torch.tensor(tags).view(1, 1, -1, 1) + layer * 0.25
        return sign * t.expand(1, heads, len(tags), dim).clone()

    first = [tag(0, -1 - j) for j in range(prefix)]    # the prompt, written and advanced as prefill does
    for layer in range(layers):
        cache.write(layer, torch.arange(prefix), rows(first, layer, 1), rows(first, layer, -1))
    cache.advance(prefix)
    committed += first
    for step, (parents, pick) in enumerate(steps, start=1):
        n, L = len(parents), cache.length
        tags = [tag(step, i) for i in range(n)]
        for layer in range(layers):
            cache.write(layer, torch.arange(L, L + n), rows(tags, layer, 1), rows(tags, layer, -1))
        path = ancestors(parents, pick % n)[::-1]       # an accepted root path, as Accepted.nodes
        cache.keep(L + torch.tensor(path))
        committed += [tags[i] for i in path]
        assert cache.length == len(committed)
        for layer in range(layers):
            k, v = cache.view(layer, cache.length)
            assert torch.equal(k, rows(committed, layer, 1)) and torch.equal(v, rows(committed, layer, -1))
    with pytest.raises(RuntimeError, match="overflow"):
        cache.keep(torch.arange(cache.length, cache.length + capacity + 1))


# ------------------------------------------------------------------------------------------ verifiers

KINDS = ("normal", "extreme", "one_hot", "uniform", "near_uniform", "zeros", "sparse")


def _logits(kind: str, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """One row of logits [V] of a given character (finite except masked entries, at least one finite)."""
    if kind == "normal":
        return torch.randn(vocab, generator=gen) * 3
    if kind == "extreme":                                # +-1e4: exp() overflows without max-subtraction
        return torch.randint(0, 2, (vocab,), generator=gen).float() * 2e4 - 1e4
    if kind == "one_hot":
        x = torch.full((vocab,), -math.inf)
        x[torch.randint(vocab, (1,), generator=gen)] = 0.0
        return x
    if kind == "uniform":
        return torch.zeros(vocab)
    if kind == "near_uniform":
        return torch.randn(vocab, generator=gen) * 1e-6
    if kind == "zeros":                                  # most of the vocabulary has probability exactly 0
        x = torch.full((vocab,), -math.inf)
        keep = torch.randperm(vocab, generator=gen)[: max(1, vocab // 4)]
        x[keep] = torch.randn(len(keep), generator=gen)
        return x
    x = torch.randn(vocab, generator=gen) * 2             # sparse: a few huge logits dominate
    x[torch.randint(vocab, (2,), generator=gen)] += 60.0
    return x


def _disjoint(p_logits: torch.Tensor, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft rows whose supports do not intersect (total disagreement); needs vocab >= 2."""
    perm = torch.randperm(vocab, generator=gen)
    cut = int(torch.randint(1, vocab, (1,), generator=gen))
    p, q = torch.full((vocab,), -math.inf), torch.full((vocab,), -math.inf)
    p[perm[:cut]] = p_logits[perm[:cut]].clamp(-50, 50).nan_to_num(0.0)
    q[perm[cut:]] = torch.randn(vocab - cut, generator=gen)
    return p, q


def _draw_without_replacement(logq: torch.Tensor, k: int, gen: torch.Generator) -> list[int]:
    """k distinct tokens from q in draw order (Gumbel-top-k), never one with q = 0."""
    support = int(torch.isfinite(logq).sum())
    keys = logq - torch.log(-torch.log(torch.rand(logq.shape, generator=gen).clamp(1e-20, 1 - 1e-7)))
    return torch.topk(keys, min(k, support)).indices.tolist()


@st.composite
def verify_cases(draw):
    """(rule name, tree, target probs [N+1, V], draft probs [N+1, V], sampling, seed)."""
    rule = draw(st.sampled_from(sorted(RULES)))
    vocab = draw(st.sampled_from([1, 2, 3, 5, 17, 64]))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    temperature = 0.0 if rule == "greedy" else draw(st.sampled_from([0.25, 1.0, 3.0]))
    sampling = SamplingParams(temperature=temperature, top_p=draw(st.sampled_from([1.0, 0.9, 0.3])),
                              top_k=draw(st.sampled_from([0, 1, 3])), min_p=draw(st.sampled_from([0.0, 0.2])))
    target_kind = draw(st.sampled_from(KINDS))
    draft_kind = draw(st.sampled_from(KINDS + ("disjoint",)))
    width = draw(st.integers(1, 4))
    depth = draw(st.integers(0, 4))
    p_rows, q_rows, tokens, parents = [], [], [0], [-1]
    node = 0
    while node < len(parents):                            # breadth first: each node gets <= width children
        p_log = _logits(target_kind, vocab, gen)
        q_log = _logits(draft_kind if draft_kind != "disjoint" else "normal", vocab, gen)
        if draft_kind == "disjoint" and vocab >= 2:
            p_log, q_log = _disjoint(p_log, vocab, gen)
        p_rows.append(process_logits(p_log, sampling).exp())
        q_rows.append(process_logits(q_log, sampling).exp())
        if len(ancestors(parents, node)) - 1 < depth and len(parents) < 40:
            if rule == "rrs_wor":                         # children drawn from q without replacement
                kids = _draw_without_replacement(process_logits(q_log, sampling), width, gen)
            else:                                         # any tokens, repeats among siblings included
                kids = torch.randint(vocab, (width,), generator=gen).tolist()
            tokens += kids
            parents += [node] * len(kids)
        node += 1
    tree = TokenTree.from_lists(tokens, parents)
    return rule, tree, torch.stack(p_rows), torch.stack(q_rows), sampling, seed


def _run_rule(rule: str, tree: TokenTree, p: torch.Tensor, q: torch.Tensor, sampling: SamplingParams,
              gen: torch.Generator) -> Accepted:
    """Call the rule the way Engine._verify does: argmax or one sample per node, or lazy probabilities."""
    r = RULES[rule]
    if r.target == "argmax":
        return r.fn(tree, p.argmax(dim=-1))
    if r.target == "sample":
        return r.fn(tree, torch.multinomial(p, 1, generator=gen).flatten())
    args = (lambda node: q[node],) if r.needs_draft else ()
    return r.fn(tree, lambda node: p[node], *args, gen)


@settings(FUZZ, max_examples=150)
@given(case=verify_cases())
def test_verifiers_emit_a_root_path_and_real_tokens(case) -> None:
    rule, tree, p, q, sampling, seed = case
    assert not torch.isnan(p).any() and not torch.isnan(q).any(), "processed probabilities must not be NaN"
    assert torch.allclose(p.sum(-1), torch.ones(len(p)), atol=1e-4)
    acc = _run_rule(rule, tree, p, q, sampling, torch.Generator().manual_seed(seed))
    parents, vocab = tree.parents.tolist(), p.shape[1]
    assert acc.nodes[0] == 0 and len(acc.tokens) == len(acc.nodes) >= 1, "at least the bonus token"
    for a, b in zip(acc.nodes, acc.nodes[1:]):
        assert parents[b] == a, f"accepted nodes {acc.nodes} are not a root path"
    assert acc.tokens[:-1] == [tree.tokens[v].item() for v in acc.nodes[1:]]
    assert all(isinstance(t, int) and 0 <= t < vocab for t in acc.tokens), acc.tokens
    for node, token in zip(acc.nodes, acc.tokens):       # every emitted token is possible under the target
        assert p[node, token] > 0, f"token {token} has target probability 0 after node {node}"
    if rule == "greedy":
        assert acc.tokens[-1] == int(p[acc.nodes[-1]].argmax())


@FUZZ
@given(tree=trees(max_nodes=30, vocab=4), choice_seed=st.integers(0, 2**31 - 1))
def test_greedy_match_is_the_deepest_matching_path(tree: TokenTree, choice_seed: int) -> None:
    """accept_greedy's pointer doubling against a plain walk: the deepest node whose whole path matches the
    target's choices (first in node order among equals), then the choice after it. A 4-token vocabulary
    makes long matches common."""
    n = tree.size + 1
    choice = torch.randint(4, (n,), generator=torch.Generator().manual_seed(choice_seed))
    parents, tokens, c = tree.parents.tolist(), tree.tokens.tolist(), choice.tolist()
    ok = [True] + [False] * (n - 1)
    for v in range(1, n):
        ok[v] = ok[parents[v]] and tokens[v] == c[parents[v]]
    depth = [len(ancestors(parents, v)) - 1 for v in range(n)]
    best = max((v for v in range(n) if ok[v]), key=lambda v: (depth[v], -v))
    acc = RULES["greedy"].fn(tree, choice)
    assert acc.nodes == ancestors(parents, best)[::-1]
    assert acc.tokens == [tokens[v] for v in acc.nodes[1:]] + [c[best]]
