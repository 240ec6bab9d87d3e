"""Dynamic builder (EAGLE-2 / DySpec): expand by cumulative draft confidence layer by layer, then rerank.

Li et al., "EAGLE-2" (arXiv 2406.16858), ALGORITHMS.md §5; the layer-wise threshold view is DySpec's
Alg. 2 (Xiong et al., arXiv 2410.11744, §3.2). A node's value is its cumulative draft log-probability.
1. Root pass; its top-k tokens are layer 1.
2. Each layer: the k best-valued nodes of the newest layer are fed to the draft in one batched pass; each gets
   its top-k tokens as children; every candidate is recorded.
3. Stop after max_depth layers, or as soon as no node of the newest layer can still place a child among the
   best `budget` recorded candidates (a child is never worth more than its parent): exact, not a heuristic.
4. Rerank: keep the best `budget` candidates (ancestor-closed; ties go to earlier nodes).

k defaults to min(32, max(4, ceil(sqrt(2 * budget)))): EAGLE-2's k = 10 at budget 60, growing with the budget
so k + depth * k^2 candidates always cover it. Children are distinct top-k tokens chosen by the draft alone,
so the tree is "deterministic": greedy, sample-and-match and EAGLE-style rejection (rrs) are exact. At T > 0
the values are the processed (temperature, top-p) draft log-probs.

Does not know: the target, verification, the draft's internals (layered.Passes runs it, reusing its cache).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..tree import TokenTree
from .layered import Growth, best_nodes, draft_passes, kth_best, pick_children


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
        passes = draft_passes(draft, self.kv_slots(budget), sampling)
        logq = passes.root(root_token)
        g = Growth.start(root_token, logq.device)
        frontier = torch.zeros(1, dtype=torch.long, device=logq.device)
        for depth in range(1, self.max_depth + 1):
            rows, _, tok, lp = pick_children(logq, k, False, None, keep_all=True)
            new = g.add(tok, frontier[rows], g.scores[frontier[rows]] + lp)
            if depth == self.max_depth:
                break
            top = g.scores[new].topk(min(k, new.numel()))
            alive = top.values > kth_best(g.scores, budget)
            frontier = new[top.indices[alive]]                     # the one host sync per pass
            if frontier.numel() == 0:
                break
            logq = g.expand(passes, frontier)
        return g.tree(passes, best_nodes(g, budget))

    def observe(self, tree: TokenTree, accepted_nodes: list[int], bonus: int) -> None:
        """EAGLE-2 learns nothing from the target at run time."""

    def kv_slots(self, budget: int) -> int:
        return 1 + (self.max_depth - 1) * self.width(budget)
