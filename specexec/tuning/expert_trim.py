"""Expert-aware trees: which nodes of a grown tree are worth verifying when a pass costs the experts its rows
route to (docs/algorithms.md §22).

For a streamed mixture-of-experts target a verification pass costs about

    T(K) = base(|K|) + sum_l s_l * sum_{e not held} 1 - prod_{v in K} (1 - P_v[l, e]) ** w_v

for the kept nodes K (root included): base(n) the rest of the pass (dense parts, compute; flat for a streamed
target), s_l the seconds to bring one expert of sparse layer l onto the device (its tier's bandwidth; 0 where
the layer is resident), P_v[l, e] the probability that node v's row routes to expert e (RoutingStats.node_probs:
its token's last routing, blended with the layer's frequencies), and the product the chance that no kept node
reads e. Rows of a tree are not independent: the j-th row kept counts as w_j = j^gamma - (j - 1)^gamma
independent rows (routing.py's correlation discount, learned from the unions passes read), so with every P_v
the layer's frequencies p this is routing.py's E[union(N)] = sum_e 1 - (1 - p_e)^(N^gamma) exactly. The step yields 1 + sum_{v in K} a_v tokens (a_v: node v's acceptance, the AcceptanceModel's rate at
the draft's probability of v's path, exp(score), calibrated by the accepted
nodes of past passes over the predicted) after the draft's D seconds, so K is chosen to maximise

    rate(K) = (1 + sum_K a_v) / (D + T(K)).

`select` orders the nodes greedily from the root, ancestor-closed (only children of ordered nodes join), in
rounds: each round prices every frontier node's marginal cost dT_v (the experts it would add that no earlier
node reads, plus base's step) and takes the best ones by a_v / dT_v (a node whose experts the tree reads
anyway costs only base's step); K is the prefix of that order with the best rate. The whole order is priced,
not cut at the first node that lowers the rate: the union saturates (with few experts, after a few rows every
expert is read and more rows are free), so the rate can fall and rise again. A node left out is
simply not verified: the target still verifies every node kept, and a sub-tree of a deterministic tree is
verified exactly by greedy and sample-and-match alike (not by rrs_wor, which needs every drafted child: the
caller does not trim those). With nothing to move (every expert held, s = 0) and a flat base the cost is flat and
the whole tree is kept: the dense case.

`node_budget` is the node-count baseline at the same predicted cost (the best-scoring nodes, as many as fit in
a pass time), for benchmarks that compare the two.

Does not know: models, devices, the builder that grew the tree, how routing is learned (routing.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from specexec.tree import TokenTree


@dataclass(frozen=True)
class TreeCost:
    """What a pass costs: seconds per expert brought in, per sparse layer [L]; held [L, E] bool: experts
    already on the device (cost nothing); base(rows) seconds of the rest of a pass of `rows` rows; draft_s
    the drafting time already spent on the tree; gamma: the rows' correlation discount (row j counts as
    j^gamma - (j-1)^gamma rows); scale multiplies the expert term (the unions passes read over the predicted)."""

    expert_s: Tensor
    held: Tensor
    base: Callable[[int], float]
    draft_s: float = 0.0
    gamma: float = 1.0
    scale: float = 1.0

    def row_weight(self, j: int) -> float:
        """How many independent rows the j-th row of a pass (1-based) counts as."""
        return j ** self.gamma - (j - 1) ** self.gamma

    def expert_weights(self) -> Tensor:
        """[L, E]: seconds each expert costs when a pass reads it (0 where held)."""
        return self.scale * self.expert_s.double()[:, None] * (~self.held).double()

    def seconds(self, probs: Tensor) -> float:
        """Predicted pass seconds for a pass over these rows' routing probabilities [K, L, E], in this order."""
        K = probs.shape[0]
        w = torch.tensor([self.row_weight(j + 1) for j in range(K)], dtype=torch.float64)
        miss = torch.exp((w[:, None, None] * torch.log1p(-probs.double().clamp(max=1 - 1e-12))).sum(dim=0))
        return self.base(K) + float(((1.0 - miss) * self.expert_weights()).sum())


def select(tree: TokenTree, value: Tensor, probs: Tensor, cost: TreeCost, batch: float = 0.125) -> Tensor:
    """The kept nodes (ascending indices, root first, ancestor-closed) of the best rate(K) along a greedy
    order (module docstring). value [N+1] each node's acceptance (the root's ignored), probs [N+1, L, E],
    cost: the pass's TreeCost. Each round adds up to max(1, batch x |K|) frontier nodes, best a_v / dT_v
    first, re-pricing each as the union grows."""
    n = tree.tokens.numel()
    if n == 1:
        return torch.zeros(1, dtype=torch.long, device=tree.device)
    parents = tree.parents.cpu()
    value = value.double().cpu()
    logq = torch.log1p(-probs.double().cpu().reshape(n, -1).clamp(max=1 - 1e-12))     # log(1 - P) [N+1, L*E]
    w = cost.expert_weights().cpu().reshape(-1)                                 # [L*E]
    kept = torch.zeros(n, dtype=torch.bool)
    kept[0] = True
    order = [0]
    miss = logq[0].exp()                                                        # P(expert not read yet)
    tokens, seconds = 1.0, cost.draft_s + cost.base(1) + float(((1.0 - miss) * w).sum()) + 1e-12
    best, best_at = tokens / seconds, 1
    while len(order) < n:
        frontier = torch.nonzero(~kept & kept[parents.clamp(min=0)]).flatten()
        frontier = frontier[frontier > 0]
        rw = cost.row_weight(len(order) + 1)
        dt = ((1.0 - (rw * logq[frontier]).exp()) * (miss * w)).sum(dim=1) + 1e-12   # [F] marginal seconds
        ranked = frontier[torch.argsort(value[frontier] / dt, descending=True)]
        for v in ranked[:max(1, int(batch * len(order)))].tolist():             # one by one: the union grows
            size = len(order)
            q = (cost.row_weight(size + 1) * logq[v]).exp()                     # P(this row misses e)
            step = max(cost.base(size + 1) - cost.base(size), 0.0)
            kept[v] = True
            order.append(v)
            tokens += float(value[v])
            seconds += float(((1.0 - q) * (miss * w)).sum()) + step
            miss = miss * q
            if tokens / seconds > best:
                best, best_at = tokens / seconds, len(order)
    return torch.sort(torch.tensor(order[:best_at], dtype=torch.long)).values.to(tree.device)


def node_budget(tree: TokenTree, probs: Tensor, cost: TreeCost, seconds: float) -> int:
    """The most best-scoring nodes (TokenTree.prune's order) whose predicted pass (cost.seconds) takes at most
    `seconds`: the node-count budget of the same predicted pass time (at least 0, at most the tree's size)."""
    order = torch.sort(tree.scores[1:].cpu(), descending=True, stable=True).indices + 1
    rows = torch.cat([torch.zeros(1, dtype=torch.long), order])
    logq = torch.log1p(-probs.double().cpu()[rows].clamp(max=1 - 1e-12))
    rw = torch.tensor([cost.row_weight(j + 1) for j in range(rows.numel())], dtype=torch.float64)
    w = cost.expert_weights().cpu()
    miss = torch.cumsum(rw[:, None, None] * logq, dim=0).exp()                  # after the first j + 1 rows
    expert = ((1.0 - miss) * w).sum(dim=(1, 2))                                 # [N+1]
    base = torch.tensor([cost.base(j + 1) for j in range(rows.numel())], dtype=torch.float64)
    fits = torch.nonzero(base + expert <= seconds + 1e-12).flatten()
    return int(fits.max()) if fits.numel() else 0


def score_values(scores: Tensor, calibration: float = 1.0) -> Tensor:
    """Each node's acceptance value [N+1]: the draft's probability of its path, exp(score), times the run's
    calibration (accepted nodes over predicted, ExpertPasses), at most 1; the root's is 0 (not drafted)."""
    out = (scores.double().cpu().exp() * calibration).clamp(max=1.0)
    out[0] = 0.0
    return out
