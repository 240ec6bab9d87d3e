"""Dynamic builder (EAGLE-2 / DySpec): expand by cumulative draft confidence layer by layer, then rerank.

Li et al., "EAGLE-2" (arXiv 2406.16858); the layer-wise threshold view is DySpec's Alg. 2 (Xiong et al.,
arXiv 2410.11744); docs/algorithms.md §10. A node's value is its cumulative draft log-probability.
1. Root pass; its top-k tokens are layer 1.
2. Each layer: the k best-valued nodes of the newest layer are fed to the draft in one batched pass; each gets
   its top-k tokens as children; every candidate is recorded.
3. Stop after max_depth layers, or as soon as no node of the newest layer can still place a child among the
   best `budget` recorded candidates (a child is never worth more than its parent): exact, not a heuristic.
4. Rerank: keep the best `budget` candidates (ancestor-closed; ties go to earlier nodes).

k defaults to min(32, max(4, ceil(sqrt(2 * budget)))): 10 at budget 50 and 11 at budget 60 (EAGLE-2 uses
k = 10 with 60 nodes), growing with the budget so k + depth * k^2 candidates always cover it. Children are
distinct top-k tokens chosen by the draft alone, so the tree is "deterministic": greedy, sample-and-match and
EAGLE-style rejection (rrs) are exact. At T > 0 the values are the processed (temperature, top-p) draft
log-probs.

One host sync per draft pass (how many of the layer's k best can still matter: the stop decision), read
together with the count the final rerank needs.

Does not know: the target, verification, the draft's internals (growth.Passes runs it, reusing its cache).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specexec.config import SamplingParams
from specexec.tree import TokenTree, best_nodes
from specexec.builders.growth import Growth, draft_passes, host_values, kth_best, pick_children
from specexec.builders.registry import register


@register
@dataclass
class DynamicBuilder:
    top_k: int | None = None        # branching and nodes expanded per layer (None: from the budget)
    max_depth: int = 16
    name: str = "dynamic"
    drafting: str = "deterministic"
    needs_draft: bool = True

    def width(self, budget: int) -> int:
        return self.top_k or min(32, max(4, math.ceil(math.sqrt(2 * budget))))

    def build(self, draft, root_token: int, budget: int, sampling: SamplingParams,
              rng: torch.Generator | None = None) -> TokenTree:
        """At most max_depth draft passes over at most k nodes each (one host sync per pass)."""
        k = self.width(budget)
        passes = draft_passes(draft, self._capacity(budget), sampling)
        logq = passes.root(root_token)
        g = Growth(root_token, 1 + k + (self.max_depth - 1) * k * k, logq.device)
        frontier, n_finite = torch.zeros(1, dtype=torch.long, device=logq.device), None
        for depth in range(1, self.max_depth + 1):
            rows, _, tok, lp = pick_children(logq, k, False, None)
            new = g.add(tok, frontier[rows], g.scores[frontier[rows]] + lp)
            if depth == self.max_depth:
                n_finite = None
                break
            top = g.scores[new].topk(min(k, new.numel()))
            alive = top.values > kth_best(g.scores[:g.n], budget)
            count, n_finite = (int(x) for x in host_values(alive.sum(), torch.isfinite(g.scores[1:g.n]).sum()))
            if count == 0:                                   # the one host sync per pass, just above
                break
            frontier = new[top.indices[:count]]              # descending: the ones that can matter come first
            logq = g.expand(passes, frontier)
        return g.tree(passes, best_nodes(g.scores[:g.n], budget, n_finite))

    def observe(self, tree: TokenTree, accepted_nodes: list[int], bonus: int) -> None:
        """EAGLE-2 learns nothing from the target at run time."""

    def _capacity(self, budget: int) -> int:
        return 1 + (self.max_depth - 1) * self.width(budget)

    def kv_slots(self, budget: int) -> int:
        return self._capacity(budget) + 1                    # + the trash slot padding rows write
