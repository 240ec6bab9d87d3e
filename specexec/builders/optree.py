"""OPT-Tree builder: grow the tree that maximises the expected acceptance length under the node budget.

Wang et al., "OPT-Tree" (TACL'25, arXiv 2406.17276). With the draft probability as the
acceptance estimate, E(A) = sum over nodes of the product of draft probabilities on the path, and for a fixed
candidate set the top-n nodes by path weight maximise it exactly.
1. Layer 1 = the root's top-w tokens (w = min(n, max_branch)); weight = draft probability.
2. Each next layer: the previous layer's nodes that can still matter (weight above the n-th best overall: a
   child never outweighs its parent) are fed to the draft in one pass; each gets its top-w children (weight =
   parent weight x probability); the layer keeps the best n of them.
3. E_t = the sum of the n best weights over all layers so far; stop when E_t - E_{t-1} <= threshold (the
   paper's delta, 0.5 by default: a draft pass must buy at least that many expected tokens), or at max_depth.
4. The tree is the best n nodes over all layers (ancestor-closed: weights never increase along a path).

max_branch caps the children per node (the paper uses n): with n = 1024 that is 1024 x 1024 candidates per
layer, nearly all of them too improbable to matter. Log-weights are kept (deep trees underflow raw products).
Children are distinct top-w tokens, so the tree is "deterministic" (greedy / sample-and-match / rrs exact).

One host sync per draft pass: E_t, how many of the layer can still matter and the rerank's count, read together.

Does not know: the target, verification, the draft's internals (growth.Passes runs it, reusing its cache).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specexec.config import SamplingParams
from specexec.tree import TokenTree, best_nodes
from specexec.builders.growth import Growth, draft_passes, host_values, kth_best, pick_children
from specexec.builders.registry import register


@register
@dataclass
class OptTreeBuilder:
    threshold: float = 0.5          # delta: the least gain in expected accepted tokens worth another layer
    max_depth: int = 10
    max_branch: int = 32
    name: str = "optree"
    drafting: str = "deterministic"
    needs_draft: bool = True

    def build(self, draft, root_token: int, budget: int, sampling: SamplingParams,
              rng: torch.Generator | None = None) -> TokenTree:
        """At most max_depth draft passes (the root's included); one host sync per pass."""
        passes = draft_passes(draft, self._capacity(budget), sampling)
        logq = passes.root(root_token)
        w = min(budget, self.max_branch)
        g = Growth(root_token, 1 + self.max_depth * budget, logq.device)
        layer = torch.zeros(1, dtype=torch.long, device=logq.device)
        gain_before = 0.0
        for depth in range(1, self.max_depth + 1):
            layer = self._add_layer(g, layer, logq, budget, w)
            scores = g.scores[:g.n]
            alive = g.scores[layer] > kth_best(scores, budget)
            gain = torch.sort(scores[1:], descending=True).values[:budget].exp().sum()
            gain, count, n_finite = host_values(gain, alive.sum(), torch.isfinite(scores[1:]).sum())   # the sync
            n_finite = int(n_finite)
            if depth == self.max_depth or gain - gain_before <= self.threshold:
                break
            gain_before = gain
            room = min(int(count), passes.capacity - passes.n_proc)
            if room <= 0:
                break
            best = torch.where(alive, g.scores[layer], float("-inf")).topk(room).indices   # out of draft slots:
            frontier = layer[torch.sort(best).values]                                     # the best first
            logq, layer = g.expand(passes, frontier), frontier
        return g.tree(passes, best_nodes(g.scores[:g.n], budget, n_finite))

    def _add_layer(self, g: Growth, parents: torch.Tensor, logq: torch.Tensor, budget: int, w: int) -> torch.Tensor:
        """Top-w children of each of `parents` [b] (draft log-probs logq [b, V]); keep the best `budget`."""
        rows, _, tok, lp = pick_children(logq, w, False, None)
        scores = g.scores[parents[rows]] + lp
        best = torch.sort(torch.topk(scores, min(budget, scores.numel())).indices).values   # keep proposal order
        return g.add(tok[best], parents[rows[best]], scores[best])

    def observe(self, tree: TokenTree, accepted_nodes: list[int], bonus: int) -> None:
        """OPT-Tree learns nothing from the target."""

    def _capacity(self, budget: int) -> int:
        return 2 * budget + 1

    def kv_slots(self, budget: int) -> int:
        return self._capacity(budget) + 1                    # + the trash slot padding rows write
