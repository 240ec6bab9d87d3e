"""SpecExec tree builder: best-first growth of the most probable continuations under a node budget.

Svirschevski et al., NeurIPS'24 (arXiv 2406.02532). Each draft pass expands up to B frontier nodes (top-w
children each, score = cumulative draft log-prob + depth * log(decay)); the tree keeps the `budget` best-scoring
nodes. Scores fall strictly along a path, so "best K" is always ancestor-closed.

Made cheap where the reference code is slow:
1. the draft's KV cache is reused: each pass computes only the newly expanded nodes, attending to the cached
   prefix and the cached K/V of their processed ancestors (growth.DraftPasses);
2. a tree uses at most 2 x budget + 1 draft KV slots: a node that drops out of the best `budget` never comes
   back (the bar only rises), nor do its descendants, so its slot is given to a node expanded later; at least
   `budget` slots are always free, so a wide frontier never runs out of slots. A pass appends at most
   `budget` children;
3. growth stops as soon as no unexpanded node can still place a child in the top `budget`
   (a child scores at most parent + log(decay));
4. one host synchronisation per draft pass (the stop decision, which also reads the frontier size), none per
   node: the tree lives in fixed-size device buffers and is selected with sort/topk/scatter, never compacted.

Width follows the cost ratio r = target pass seconds / draft pass seconds (`cost_ratio` pinned, else what the
engine measured through `observe_costs`, else unknown = economy). At r <= narrow_ratio (a CPU, where a draft
pass over many rows costs a good part of a target pass) a pass expands at most budget / beam_fraction nodes:
a narrow frontier grows deeper trees per draft FLOP. At r >= wide_ratio (a GPU streaming the target: a pass
costs ~100 draft passes of any width up to a few hundred rows) it expands up to max_beams, the paper's width,
which reaches the best `budget` nodes in fewer passes. In between the fraction moves geometrically.

Children of a node are distinct tokens (top-w), so the tree is "deterministic" drafting: exact verification
rules are greedy match, sample-and-match (the paper's) and EAGLE-style rejection (verify.py).

Does not know: the target model, verification, sampling beyond the draft's processed distribution.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specexec.config import SamplingParams
from specexec.tree import TokenTree, best_nodes
from specexec.builders.growth import Growth, draft_passes, host_values
from specexec.builders.registry import register


def processed_capacity(budget: int) -> int:
    """Draft KV slots one tree may use: the root plus up to 2 x budget expanded nodes (some expanded nodes
    drop out of the best `budget` when better ones appear)."""
    return 2 * budget + 1


@dataclass
class CostRatio:
    """A running (log-space exponential) mean of r = target pass seconds / draft pass seconds."""

    weight: float = 0.3
    log_r: float | None = None

    def add(self, draft_s: float, target_s: float, passes: int) -> None:
        if passes <= 0 or draft_s <= 0 or target_s <= 0:
            return
        x = math.log(target_s * passes / draft_s)
        self.log_r = x if self.log_r is None else (1 - self.weight) * self.log_r + self.weight * x

    @property
    def value(self) -> float | None:
        return None if self.log_r is None else math.exp(self.log_r)


def width_fraction(ratio: float | None, narrow: float, wide: float, economy: float) -> float:
    """budget / nodes expanded per pass: `economy` at ratio <= narrow (or unknown), 1 at ratio >= wide,
    geometric in between."""
    if ratio is None or ratio <= narrow:
        return economy
    if ratio >= wide:
        return 1.0
    return economy ** (math.log(wide / ratio) / math.log(wide / narrow))


@register
@dataclass
class SpecExecBuilder:
    """Paper defaults: up to 128 beams per pass, top-32 children, at most 32 draft passes, depth decay 0.95."""

    max_beams: int = 128
    max_branch: int = 32
    max_passes: int = 32
    decay: float = 0.95
    beam_fraction: int = 8          # economy: expand at most budget / beam_fraction nodes per pass (>= 1)
    cost_ratio: float | None = None  # pinned r = target pass s / draft pass s (None: the engine measures it)
    narrow_ratio: float = 32.0
    wide_ratio: float = 64.0
    name: str = "specexec"
    drafting: str = "deterministic"
    needs_draft: bool = True
    measured: CostRatio = field(default_factory=CostRatio, repr=False)

    def ratio(self) -> float | None:
        return self.cost_ratio if self.cost_ratio is not None else self.measured.value

    def beams(self, budget: int) -> int:
        """Frontier nodes one draft pass may expand at this budget and cost ratio."""
        f = width_fraction(self.ratio(), self.narrow_ratio, self.wide_ratio, self.beam_fraction)
        return max(1, min(self.max_beams, budget, int(budget / f)))

    def observe_costs(self, draft_s: float, target_s: float, draft_passes: int) -> None:
        """The engine reports each step's drafting and target seconds and the draft passes it ran."""
        self.measured.add(draft_s, target_s, draft_passes)

    def build(self, draft, root_token: int, budget: int, sampling: SamplingParams,
              rng: torch.Generator | None = None) -> TokenTree:
        """Grow a tree of at most `budget` non-root nodes under `root_token` (see the module docstring)."""
        passes = draft_passes(draft, processed_capacity(budget), sampling)
        logq = passes.root(root_token)
        beams, w = self.beams(budget), min(self.max_branch, budget, logq.shape[-1])
        g = Growth(root_token, 1 + self.max_passes * min(budget, beams * w), logq.device)
        alive = torch.zeros(g.capacity, dtype=torch.bool, device=logq.device)
        alive[0] = True
        owner = torch.full((passes.capacity,), -1, dtype=torch.long, device=logq.device)   # node per KV slot
        owner[0] = 0
        frontier, n_alive = torch.zeros(1, dtype=torch.long, device=logq.device), None
        for p in range(self.max_passes):
            theta = self._add_children(g, alive, frontier, logq, budget, w)
            n = g.n
            if p == self.max_passes - 1:
                break
            can = alive[:n] & (g.proc[:n] < 0) & (g.scores[:n] + math.log(self.decay) > theta)
            free = (owner < 0) | ~alive[owner.clamp(min=0)]
            n_can, n_alive, n_free = (int(x) for x in host_values(can.sum(), alive[:n].sum(), free.sum()))
            b = min(n_can, beams, n_free)                                     # ^ the one host sync per pass
            if b <= 0:
                break
            frontier = torch.where(can, g.scores[:n], float("-inf")).topk(b).indices
            slots = torch.sort((~free).to(torch.uint8), stable=True).indices[:b]       # free slots, lowest first
            owner[slots] = frontier
            logq = g.expand(passes, frontier, slots)
            n_alive = None
        if n_alive is None:
            n_alive = int(host_values(alive[:g.n].sum())[0])
        keep = best_nodes(torch.where(alive[:g.n], g.scores[:g.n], float("-inf")), budget, n_alive - 1)
        return g.tree(passes, keep)

    def _add_children(self, g: Growth, alive: Tensor, frontier: Tensor, logq: Tensor, budget: int,
                      w: int) -> Tensor:
        """Top-w children of each frontier node [b]; the best min(budget, b * w) are appended, and `alive`
        becomes the best `budget` of all nodes (ties: earlier nodes). Returns the budget-th best score on the
        device (-inf while fewer than `budget` nodes exist)."""
        top_lp, top_tok = logq.topk(w, dim=-1)                                  # [b, w]
        child = (g.scores[frontier, None] + top_lp + math.log(self.decay)).flatten()
        best = child.topk(min(budget, child.numel()))                          # descending: a parent's children
        first = g.n                                                             # stay in proposal order
        g.add(top_tok.flatten()[best.indices], frontier[best.indices // w], best.values)
        n = g.n
        old = torch.arange(n, device=alive.device) < first
        key = torch.where(alive[:n] | ~old, g.scores[:n], float("-inf"))
        key[0] = float("-inf")
        order = torch.sort(key, descending=True, stable=True).indices[:budget]
        alive[:n] = False
        alive[order] = torch.isfinite(key[order])
        alive[0] = True
        if order.numel() == budget:
            return key[order[-1:]].squeeze(0)
        return torch.full((), float("-inf"), dtype=key.dtype, device=key.device)     # a fill: no upload

    def observe(self, tree: TokenTree, accepted_nodes: list[int], bonus: int) -> None:
        """SpecExec learns nothing from the target."""

    def kv_slots(self, budget: int) -> int:
        return processed_capacity(budget) + 1                 # + the trash slot padding rows write
