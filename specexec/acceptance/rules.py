"""Acceptance rules: which path of a draft tree the target agrees with, plus one bonus token (docs/algorithms.md §5).

Rules, and the drafting schemes each is exact for:
- V1 greedy match / V2 sample-and-match (`accept_greedy`): any tree. The engine passes one choice per node:
  the target's argmax (T = 0) or one independent target sample per node (T > 0, SpecExec's rule).
- V3 deterministic-draft RRS (`accept_rrs_deterministic`, EAGLE): children are distinct tokens chosen without
  looking at the target (top-k, static, recycling trees). Accept child x with prob r(x), zero it, renormalise.
- V5 RRS without replacement (`accept_rrs_without_replacement`, RSD/Sequoia/DySpec): children were drawn from q
  without replacement and are listed in draw order. Accept with min(1, r/q); r <- norm(max(r - q, 0)),
  q <- norm(q without x). Using V5 on top-k children, or on re-sorted children, is biased (pitfall 1).

The probability-based rules walk the tree from the root and ask for the target's (and draft's) processed
probabilities only at the nodes they visit, through callbacks, so the engine evaluates the LM head lazily.

Does not know: models, caches, logits processing (probabilities arrive already processed), tree builders.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from specexec.config import SamplingParams
from specexec.options import check_choice
from specexec.tree import TokenTree
from specexec.uploads import upload

ProbsFn = Callable[[int], Tensor]          # node -> processed probabilities [V] at that node


@dataclass
class Accepted:
    """nodes: accepted tree nodes root -> deepest (node 0 included); tokens: the accepted non-root nodes'
    tokens followed by ONE bonus token from the target (so len(tokens) == len(nodes)). relaxed: under relaxed
    acceptance (specexec/acceptance/relaxed.py), per token whether it differs from what exact acceptance chose at its node
    (empty: an exact rule). Read in the rule's one transfer to the host, so the step needs no other: root, the
    root's token; depth, the tree's largest depth; draft_slots, tree.draft_slots at `nodes` (None without them)."""

    nodes: list[int]
    tokens: list[int]
    relaxed: tuple[bool, ...] = ()
    root: int = field(default=-1, compare=False)
    depth: int = field(default=-1, compare=False)
    draft_slots: list[int] | None = field(default=None, compare=False)


def _host_tree(tree: TokenTree, *extra: Tensor) -> tuple[list[int], list[int], int, list[int] | None, list]:
    """(parents, tokens, max depth, draft slots or None, each extra as a list) in ONE device-to-host transfer."""
    n = tree.tokens.numel()
    parts = [tree.parents, tree.tokens, tree.depths.max().reshape(1)]
    if tree.draft_slots is not None:
        parts.append(tree.draft_slots)
    host = torch.cat(parts + [x.reshape(-1).long() for x in extra]).tolist()
    parents, tokens, depth, at = host[:n], host[n:2 * n], host[2 * n], 2 * n + 1
    slots = None
    if tree.draft_slots is not None:
        slots, at = host[at:at + n], at + n
    rest = []
    for x in extra:
        rest.append(host[at:at + x.numel()])
        at += x.numel()
    return parents, tokens, depth, slots, rest


def _accepted(nodes: list[int], tokens: list[int], bonus: int, depth: int, slots: list[int] | None) -> Accepted:
    return Accepted(nodes, [tokens[v] for v in nodes[1:]] + [bonus], root=tokens[0], depth=depth,
                    draft_slots=None if slots is None else [slots[v] for v in nodes])


def accept_greedy(tree: TokenTree, target_choice: Tensor) -> Accepted:
    """V1 (target_choice = argmax per node) and V2 (= one independent target sample per node).

    tree: N+1 nodes; target_choice long [N+1], the target's token after each node. A node is accepted iff
    tokens[v] == choice[parents[v]] for it and all its ancestors; the deepest accepted node wins (first in
    node order on ties, e.g. duplicate siblings); bonus = choice[deepest]. Vectorised by pointer doubling
    (log2 N steps, no host sync) and one host transfer at the end.
    """
    n = tree.tokens.numel()
    choice = target_choice.to(tree.device).long().reshape(-1)
    if choice.numel() != n:
        raise ValueError(f"target_choice has {choice.numel()} entries for a tree of {n} nodes")
    up = tree.parents.clamp(min=0)                               # root points at itself
    good = tree.tokens == choice[up]
    good[0] = True
    for _ in range(max(1, math.ceil(math.log2(n + 1)))):        # good[v]: v and its 2^k - 1 nearest ancestors ok
        good = good & good[up]
        up = up[up]
    best = torch.argmax(torch.where(good, tree.depths, -1))     # first maximum: earliest node among the deepest
    parents, tokens, depth, slots, (deepest, chosen) = _host_tree(tree, best, choice)
    nodes = [deepest[0]]
    while parents[nodes[-1]] >= 0:
        nodes.append(parents[nodes[-1]])
    nodes.reverse()
    return _accepted(nodes, tokens, chosen[nodes[-1]], depth, slots)




def _draw(dist: Tensor, generator: torch.Generator | None) -> int:
    """One token from the (unnormalised, non-negative) distribution dist [V]."""
    return int(torch.multinomial(dist.float(), 1, generator=generator))


def _walk(tree: TokenTree, step: Callable[[int, list[int], list[int]], tuple[int | None, Tensor]],
          target_probs_fn: ProbsFn, generator: torch.Generator | None) -> Accepted:
    """Shared root-to-leaf walk: `step(node, children, child_tokens)` returns (accepted child or None, the
    distribution to draw the bonus from if None). A leaf's bonus comes from the target at that leaf."""
    parents, tokens, depth, slots, _ = _host_tree(tree)
    kids: list[list[int]] = [[] for _ in parents]               # children in proposal order
    for v, p in enumerate(parents[1:], start=1):
        kids[p].append(v)
    nodes = [0]
    while True:
        u = nodes[-1]
        if not kids[u]:
            bonus = _draw(target_probs_fn(u), generator)
            break
        child, residual = step(u, kids[u], [tokens[c] for c in kids[u]])
        if child is None:
            bonus = _draw(residual, generator)
            break
        nodes.append(child)
    return _accepted(nodes, tokens, bonus, depth, slots)


def accept_rrs_deterministic(tree: TokenTree, target_probs_fn: ProbsFn,
                             generator: torch.Generator | None = None) -> Accepted:
    """V3 (EAGLE-style RRS) for trees whose children are distinct tokens fixed without looking at the target.

    At node u with r = p(.|u): children in proposal order, accept x_i with prob r_i(x_i), where r_i is p with
    the earlier children zeroed and renormalised (closed form, one host sync per visited node); if all are
    rejected, the bonus comes from p with every child zeroed. A repeated sibling token counts as rejected.
    target_probs_fn(node) -> processed target probabilities [V] at that node.
    """
    def step(u: int, children: list[int], toks: list[int]) -> tuple[int | None, Tensor]:
        p = target_probs_fn(u).float()
        idx = upload(toks, p.device)
        *px, left = torch.cat([p[idx], p.sum().reshape(1)]).tolist()        # one host sync per node
        draws = torch.rand(len(toks), generator=generator, device=p.device).tolist()
        for i, (child, x) in enumerate(zip(children, toks)):
            if x in toks[:i]:                                                # repeated sibling: r(x) = 0
                continue
            if draws[i] * left < px[i]:                                      # prob r_i(x_i) = px / left
                return child, p
            left -= px[i]
        residual = p.index_fill(0, idx, 0.0)
        return None, residual if bool(residual.sum() > 0) else p            # pitfall 3: zero-mass residual
    return _walk(tree, step, target_probs_fn, generator)


def _rrs_round(r: Tensor, q: Tensor, x: int, tried: list[int]) -> tuple[Tensor, Tensor]:
    """After rejecting x: r <- norm(max(r - q, 0)) (zero mass: r without x), q <- norm(q without x) (zero
    mass: uniform over the untried tokens, as Sequoia does). r, q [V] normalised."""
    res = (r - q).clamp_min_(0.0)
    q = q.clone()
    q[x] = 0.0
    res_mass, q_mass = torch.stack([res.sum(), q.sum()]).tolist()
    if res_mass <= 0.0:                                                       # r == q up to rounding
        res = r.clone()
        res[x] = 0.0
        res_mass = float(res.sum())
        res, res_mass = (res, res_mass) if res_mass > 0.0 else (r, 1.0)
    if q_mass <= 0.0:
        q = torch.ones_like(q).index_fill_(0, upload(tried, q.device), 0.0)
        q_mass = float(q.sum())
    return res / res_mass, q / q_mass


def accept_rrs_without_replacement(tree: TokenTree, target_probs_fn: ProbsFn, draft_probs_fn: ProbsFn,
                                   generator: torch.Generator | None = None) -> Accepted:
    """V5 (recursive rejection sampling without replacement; RSD, Sequoia Alg. 2, DySpec Alg. 3).

    Children must be draws without replacement from q = draft_probs_fn(node) [V], listed in draw order. At
    node u, r = p(.|u): accept x_i with prob min(1, r(x_i) / q(x_i)); on rejection update r and q
    (`_rrs_round`); if every child is rejected the bonus comes from the final r. Raises if a child has
    q(x) = 0: such a tree was not drawn from this q (pitfall 2), so no exact answer exists.
    """
    def step(u: int, children: list[int], toks: list[int]) -> tuple[int | None, Tensor]:
        p, q = target_probs_fn(u).float(), draft_probs_fn(u).float()
        r, q = p / p.sum(), q / q.sum()
        u_rand = torch.rand(len(toks), generator=generator, device=p.device).tolist()
        for i, (child, x) in enumerate(zip(children, toks)):
            rx, qx = torch.stack([r[x], q[x]]).tolist()
            if qx <= 0.0:
                raise ValueError(f"node {child} (token {x}) has draft probability 0 at node {u}: the tree was "
                                 "not sampled from these draft probabilities, or a sibling repeats")
            if u_rand[i] < rx / qx:
                return child, r
            r, q = _rrs_round(r, q, x, toks[:i + 1])
        return None, r
    return _walk(tree, step, target_probs_fn, generator)


@dataclass(frozen=True)
class Rule:
    """A registered acceptance rule: `fn`, a one-line `doc`, what the target must hand over per node
    (`target`: "argmax" | "sample" | "probs") and whether the draft's probabilities are needed."""

    name: str
    fn: Callable[..., Accepted]
    doc: str
    target: str
    needs_draft: bool = False


RULES: dict[str, Rule] = {
    "greedy": Rule("greedy", accept_greedy, "V1: follow the target's argmax; exact at temperature 0 only.",
                   "argmax"),
    "sample_match": Rule("sample_match", accept_greedy,
                         "V2: follow one target sample per node; exact for any tree (SpecExec).", "sample"),
    "rrs": Rule("rrs", accept_rrs_deterministic,
                "V3: EAGLE-style RRS; exact for distinct children fixed without the target.", "probs"),
    "rrs_wor": Rule("rrs_wor", accept_rrs_without_replacement,
                    "V5: RRS without replacement; exact for children drawn from q in draw order.", "probs",
                    needs_draft=True),
}

_EXACT = {
    "deterministic": ("greedy", "sample_match", "rrs"),
    "without_replacement": ("greedy", "sample_match", "rrs_wor"),
}


def verifier_names() -> tuple[str, ...]:
    """The accepted values of --verifier / EngineConfig.verifier: "auto" (the builder's own) and every rule."""
    return ("auto", *RULES)


def check_verifier(name: str) -> None:
    """ConfigError (listing verifier_names()) unless `name` is one of them."""
    check_choice("verifier", name, verifier_names())


def exact_rules_for(drafting: str, sampling: SamplingParams | None = None) -> tuple[str, ...]:
    """Rules that keep the target's distribution exactly for trees drafted this way (docs/algorithms.md §5.5).

    drafting: "deterministic" (distinct children chosen by the draft alone: specexec, dynamic, optree,
    recycling builders) or "without_replacement" (children drawn from q without replacement: rsd, chain,
    static). With `sampling` given, "greedy" is kept only at temperature 0, where it is
    the only rule (the others would need one-hot target distributions).
    """
    if drafting not in _EXACT:
        raise ValueError(f"unknown drafting kind {drafting!r}; known: {', '.join(_EXACT)}")
    if sampling is None:
        return _EXACT[drafting]
    if sampling.greedy:
        return ("greedy",)
    return tuple(r for r in _EXACT[drafting] if r != "greedy")


def default_rule(drafting: str, sampling: SamplingParams) -> str:
    """"greedy" at T = 0; else "sample_match" for deterministic trees, "rrs_wor" for without-replacement."""
    exact_rules_for(drafting)                                                 # validates the kind
    if sampling.greedy:
        return "greedy"
    return "rrs_wor" if drafting == "without_replacement" else "sample_match"
