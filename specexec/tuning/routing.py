"""Routing statistics of a mixture-of-experts target, and the expected expert union of a pass: how many distinct
experts one pass over N rows reads in each sparse layer (docs/algorithms.md §22).

The union model. A row routes to k of a layer's E experts; p[e] = P(a row routes to expert e), sum_e p = k.
For N independent rows expert e is read unless no row picks it, P(e read) = 1 - (1 - p[e])^N. The rows of one
tree are not independent (they share a prefix, repeat tokens, and neighbouring tokens route alike), so N
becomes n_eff = N ** gamma (gamma <= 1: the correlation discount), and

    E[union(N)] = sum_e 1 - (1 - p[e]) ** (N ** gamma)

over the experts not held on the device (an expert cache keeps the `cached` most often read: the sum skips
them). With no data the prior is uniform routing, p = k / E, and gamma = PRIOR_GAMMA. Online (RoutingStats):
p from decayed counts of every row's experts per layer blended with the uniform prior (worth PRIOR_ROWS rows),
and gamma fitted to the unions the passes actually read (each pass and layer: n_eff solved from the observed
union, gamma = log n_eff / log N, a decayed mean beside a prior worth PRIOR_PASSES passes).

Per-node predictions, for expert-aware trees (specexec/tuning/expert_trim.py): the experts each token was last
routed to in each layer (a table over TOKEN_BUCKETS hashed token ids) and a learned repeat rate alpha (the share
of a row's experts that its token's previous row also had, beyond chance; 0 until tokens repeat): P(a row of token t routes to e) = alpha [e in
last(t)] + (1 - alpha) p[e] (sums to k); a token never seen has the layer's p.

Does not know: models, devices' bytes or speeds, trees (a pass is a set of rows), which experts are resident.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

PRIOR_GAMMA = 0.8         # n_eff = N ** 0.8 before any pass was seen: 17 tree rows count as 9.6 independent ones
PRIOR_ROWS = 64.0         # the uniform prior on p is worth this many rows per layer
PRIOR_PASSES = 2.0        # the prior gamma is worth this many observed passes
PRIOR_REPEATS = 8.0       # the prior repeat rate (chance) is worth this many rows of a token seen before
TOKEN_BUCKETS = 4096      # hashed token ids of the last-routing table


def union_size(p: Sequence[float] | Tensor, rows: float, gamma: float = PRIOR_GAMMA, cached: int = 0) -> float:
    """E[distinct experts read] by a pass of `rows` rows, routing frequencies p [E] (sum = top-k), the `cached`
    most frequent experts not counted (held on the device)."""
    p = torch.as_tensor(p, dtype=torch.float64)
    return float(union_sizes(p[None], rows, gamma, cached)[0])


def union_sizes(p: Tensor, rows: float, gamma: float = PRIOR_GAMMA, cached: int = 0) -> Tensor:
    """union_size for each layer: p [L, E] -> [L] (float64)."""
    p = p.double().clamp(0.0, 1.0)
    n_eff = max(float(rows), 1.0) ** gamma
    hit = 1.0 - (1.0 - p) ** n_eff                                                  # [L, E]
    if cached > 0:
        hit = hit.sort(dim=-1, descending=True).values[:, min(cached, hit.shape[-1]):]
    return hit.sum(dim=-1)


def uniform_union(n_experts: int, top_k: int, rows: float, gamma: float = PRIOR_GAMMA, cached: int = 0) -> float:
    """The prior's E[union]: uniform routing (every expert read alike, so caching c of E leaves (E - c) / E)."""
    p = top_k / n_experts
    read = n_experts * (1.0 - (1.0 - p) ** (max(float(rows), 1.0) ** gamma))
    return read * (n_experts - min(cached, n_experts)) / n_experts


def solve_n_eff(p: Tensor, union: Tensor, rows: Tensor | float, iters: int = 40) -> Tensor:
    """Per layer the n (1 <= n <= 4 rows) with sum_e 1 - (1 - p[e])^n = union: p [L, E], union [L] -> [L]
    (bisection in log n; a union at or above what n = 4 rows predicts gives 4 rows, below one row's gives 1)."""
    p = p.double().clamp(0.0, 1.0 - 1e-9)
    rows = torch.as_tensor(rows, dtype=torch.float64).expand_as(union.double())
    lo, hi = torch.zeros_like(rows), torch.log(4.0 * rows.clamp(min=1.0))
    for _ in range(iters):
        mid = (lo + hi) / 2
        u = (1.0 - (1.0 - p) ** mid.exp()[:, None]).sum(dim=-1)
        below = u < union.double()
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    return ((lo + hi) / 2).exp()


class RoutingStats:
    """What the target's sparse layers routed to in past passes: decayed counts per layer and expert, the unions
    read, gamma, and each token's last routing (see the module docstring). `layers` are the sparse layers'
    indices (rows of every tensor here follow their order)."""

    def __init__(self, layers: Sequence[int], n_experts: int, top_k: int, device: torch.device | str = "cpu",
                 decay: float = 0.98) -> None:
        self.layers, self.n_experts, self.top_k = tuple(layers), n_experts, top_k
        self.decay, self.device = decay, torch.device(device)
        L = len(self.layers)
        self.counts = torch.zeros(L, n_experts, dtype=torch.float64, device=self.device)
        self.rows = 0.0                                             # decayed rows seen (per layer, alike)
        self.gamma_sum, self.gamma_weight = 0.0, 0.0                # decayed sum / weight of observed gammas
        self.alpha_sum = torch.zeros(L, dtype=torch.float64)              # decayed repeats per layer / k
        self.alpha_weight = 0.0                                               # decayed rows seen before
        self.last = torch.full((TOKEN_BUCKETS, L, top_k), -1, dtype=torch.long, device=self.device)
        self.passes = 0
        self.union_history: list[tuple[int, float]] = []           # (rows, mean union per layer) per pass

    # -- what the model says

    @property
    def gamma(self) -> float:
        return (PRIOR_GAMMA * PRIOR_PASSES + self.gamma_sum) / (PRIOR_PASSES + self.gamma_weight)

    @property
    def alphas(self) -> Tensor:
        """Per sparse layer [L] the repeat rate beyond chance: m, the share of a token's last experts its next
        row has again, is alpha + (1 - alpha) k / E, so alpha = (m - k/E) / (1 - k/E) (0 for routing that
        ignores the token; early layers, which see little context, repeat most)."""
        chance = self.top_k / self.n_experts
        m = (chance * PRIOR_REPEATS + self.alpha_sum) / (PRIOR_REPEATS + self.alpha_weight)
        return torch.zeros_like(m) if chance >= 1 else ((m - chance) / (1 - chance)).clamp(0.0, 1.0)

    @property
    def alpha(self) -> float:
        """The mean of `alphas` over the sparse layers."""
        return float(self.alphas.mean())

    def frequencies(self) -> Tensor:
        """p [L, E] (float64, each row sums to top_k): counts blended with the uniform prior."""
        prior = self.top_k / self.n_experts
        return (self.counts + PRIOR_ROWS * prior) / (self.rows + PRIOR_ROWS)

    def expected_union(self, rows: float, cached: int = 0) -> Tensor:
        """E[distinct experts read] per sparse layer [L] by a pass of `rows` rows, `cached` hottest held."""
        return union_sizes(self.frequencies(), rows, self.gamma, cached)

    def hottest(self, count: int) -> Tensor:
        """The `count` most often routed-to experts of each layer [L, count], hottest first (expert cache)."""
        return self.counts.topk(min(count, self.n_experts), dim=-1).indices

    def node_probs(self, tokens: Tensor) -> Tensor:
        """P(row routes to e) [N, L, E] for rows of these tokens [N]: alpha on the experts the token last had,
        the layer's frequencies otherwise (a token never seen: the frequencies alone)."""
        p = self.frequencies().to(torch.float32)                                   # [L, E]
        last = self.last[tokens.to(self.device) % TOKEN_BUCKETS]                    # [N, L, k]
        seen = (last >= 0)
        onehot = torch.zeros(tokens.numel(), len(self.layers), self.n_experts, device=self.device)
        onehot.scatter_(2, last.clamp(min=0), seen.float())
        a = self.alphas.to(device=self.device, dtype=torch.float32)[None, :, None]    # [1, L, 1]
        known = seen.any(dim=-1, keepdim=True).float()                              # [N, L, 1]
        return known * (a * onehot + (1 - a) * p) + (1 - known) * p

    # -- learning from a pass

    def observe(self, tokens: Tensor, routing: Mapping[int, Tensor]) -> None:
        """One target pass: tokens [T] of its rows and, per sparse layer, their routing index [T, k]
        (specexec.network.moe.RoutingLog.layers). One host read (the pass's unions and repeat rate)."""
        index = torch.stack([routing[i].reshape(-1, self.top_k) for i in self.layers], dim=1).to(self.device)
        T = index.shape[0]                                                          # index [T, L, k]
        p_before = self.frequencies()
        bins = torch.zeros(len(self.layers), self.n_experts, dtype=torch.float64, device=self.device)
        bins.scatter_add_(1, index.transpose(0, 1).reshape(len(self.layers), -1),
                          torch.ones(len(self.layers), T * self.top_k, dtype=torch.float64, device=self.device))
        union = (bins > 0).sum(dim=-1).double()                                      # [L]
        buckets = tokens.reshape(-1).to(self.device) % TOKEN_BUCKETS
        prev = self.last[buckets]                                                    # [T, L, k]
        had = prev[:, :, :1] >= 0                                                    # [T, L, 1]
        same = (index[:, :, :, None] == prev[:, :, None, :]).any(-1) & had           # [T, L, k]
        n_had = had[:, 0].sum()
        n_eff = solve_n_eff(p_before, union, float(T)) if T > 1 else None
        values = [union.mean(), n_had.double(), *same.sum(dim=(0, 2)).double()]
        if n_eff is not None:
            values.append(torch.log(n_eff).mean())
        host = torch.stack(values).tolist()                                         # the one host read
        L = len(self.layers)
        self.counts = self.counts * self.decay + bins
        self.rows = self.rows * self.decay + T
        self.last[buckets] = index
        self.passes += 1
        self.union_history.append((T, host[0]))
        del self.union_history[:-256]
        if host[1] > 0:
            self.alpha_sum = self.alpha_sum * self.decay + torch.tensor(host[2:2 + L], dtype=torch.float64) / self.top_k
            self.alpha_weight = self.alpha_weight * self.decay + host[1]
        if n_eff is not None:
            g = min(max(host[2 + L] / math.log(T), 0.0), 1.0)
            self.gamma_sum = self.gamma_sum * self.decay + g
            self.gamma_weight = self.gamma_weight * self.decay + 1.0

    def to_json(self) -> dict:
        """A summary for stats lines: gamma, alpha, passes seen, the last passes' mean unions."""
        return {"gamma": round(self.gamma, 4), "alpha": round(self.alpha, 4), "passes": self.passes}
