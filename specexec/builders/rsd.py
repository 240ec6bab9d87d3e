"""RSD builders: Recursive Speculative Decoding, trees sampled without replacement, verified by recursive
rejection sampling in sampling order (V5, rrs_wor), which is exact at any temperature.

Jeon et al., "Recursive Speculative Decoding" (arXiv 2402.14160).
- `rsd` = RSD-S, stochastic beam search (Kool et al., ICML'19): beam width W and depth L with W * L <= budget.
  Each beam y keeps phi(y) (cumulative draft log-prob) and a perturbed value G(y) (root: 0, 0). Per depth, every
  beam's next tokens get G'(yx) = phi(yx) + Gumbel; Z(y) = max_x G'(yx); the values are conditioned on the
  parent, G(yx) = -log(exp(-G(y)) - exp(-Z(y)) + exp(-G'(yx))) (stable form, float64); the global top-W of all
  (y, x) become the next beams and tree nodes. Within one parent the kept children are a prefix of a Gumbel
  top-k ordering, i.e. a without-replacement sample of q(.|y) in draw order: nodes are added in descending G,
  which is that order. How many survive depends on the values only, not on token identities.
  Only each beam's W best perturbed tokens can be kept, so G is computed for those alone ([W, W], not [W, V]).
- `rsd-c` = RSD-C, constant branching: every node at depth l gets b_l children by Gumbel-top-b_l; the shape
  is filled breadth first and cut at the budget (a node's kept children are a prefix of its draws).
At temperature 0 the Gumbel noise is dropped: RSD-S becomes beam search, RSD-C top-k (any tree is exact then).
`draft_probs` hands the verifier the processed q each node's children were drawn from.

RSD-S makes one host sync per level (how many of the W best are finite: also the stop decision); RSD-C is the
static builder's drafting (no sync per pass).

Does not know: the target, verification, the draft's internals (growth.Passes runs it, reusing its cache).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from specexec.config import SamplingParams
from specexec.sampling import gumbel_topk
from specexec.tree import TokenTree
from specexec.builders.growth import DrawsWithoutReplacement, Growth, draft_passes, host_values
from specexec.builders.static import Shape, StaticBuilder
from specexec.builders.registry import register


def shift_gumbel(g_child: Tensor, g_parent: Tensor, z: Tensor) -> Tensor:
    """G(yx) = -log(exp(-G(y)) - exp(-Z(y)) + exp(-G'(yx))), stably (Kool et al. 2019, App. B).
    g_child [b, w] perturbed child values G'; g_parent, z [b, 1]. float64; -inf children stay -inf."""
    u = g_parent - g_child + torch.log1p(-torch.exp(g_child - z))
    return g_parent - u.clamp(min=0) - torch.log1p(torch.exp(-u.abs()))


@register
@dataclass
class RSDBuilder(DrawsWithoutReplacement):
    """RSD-S: beam width W = budget // L over L = depth (default round(sqrt(budget)), at most max_depth)."""

    depth: int | None = None
    max_depth: int = 16
    name: str = "rsd"
    drafting: str = "without_replacement"
    needs_draft: bool = True

    def beam(self, budget: int) -> tuple[int, int]:
        """(W, L) for a budget: W * L <= budget."""
        L = max(1, min(self.depth or round(math.sqrt(budget)), self.max_depth, budget))
        return budget // L, L

    def build(self, draft, root_token: int, budget: int, sampling: SamplingParams,
              rng: torch.Generator | None = None) -> TokenTree:
        """L levels of stochastic beam search (L - 1 draft passes over at most W beams each)."""
        W, L = self.beam(budget)
        passes = draft_passes(draft, budget + 1, sampling)
        logq = passes.root(root_token)
        self._q.reset(logq, passes, keep=not sampling.greedy)
        g = Growth(root_token, 1 + W * L, logq.device)
        beams = torch.zeros(1, dtype=torch.long, device=logq.device)
        values = torch.zeros(1, dtype=torch.float64, device=logq.device)
        for depth in range(1, L + 1):
            beams, values = self._level(g, beams, values, logq, W, sampling, rng)
            if depth == L or beams.numel() == 0:
                break
            logq = g.expand(passes, beams)
            self._q.add(logq)
        return g.tree(passes)

    def _level(self, g: Growth, beams: Tensor, values: Tensor, logq: Tensor, W: int, sampling: SamplingParams,
               rng: torch.Generator | None) -> tuple[Tensor, Tensor]:
        """Children of `beams` [b] (values G [b], draft log-probs logq [b, V]): the global top-W by G, added
        in descending G. Returns the new beams and their G. One host sync."""
        w = min(W, logq.shape[-1])
        phi = g.scores[beams].double()[:, None]                              # [b, 1]
        if sampling.greedy:
            lp, tok = logq.topk(w, dim=-1)
            child = phi + lp.double()
        else:
            tok, keys = gumbel_topk(logq, w, rng)                              # keys = log q + Gumbel
            child = shift_gumbel(phi + keys.double(), values[:, None], phi + keys[:, :1].double())
            lp = logq.gather(1, tok.clamp(min=0))
        top = child.flatten().topk(min(W, child.numel()))
        count = int(host_values(torch.isfinite(top.values).sum())[0])         # the one host sync
        pick = top.indices[:count]                                               # descending: finite first
        rows, toks = pick // w, tok.flatten()[pick]
        new = g.add(toks, beams[rows], g.scores[beams[rows]] + lp.flatten()[pick])
        return new, top.values[:count]


def branching_shape(budget: int, branching: tuple[int, ...]) -> Shape:
    """Every node at depth l gets branching[l - 1] children, breadth first, cut after `budget` nodes."""
    parents, level = [-1], [0]
    for b in branching:
        nxt = []
        for node in level:
            for _ in range(b):
                if len(parents) > budget:
                    return Shape.from_parents(parents)
                nxt.append(len(parents))
                parents.append(node)
        level = nxt
    return Shape.from_parents(parents)


@register
@dataclass
class RSDConstantBuilder(StaticBuilder):
    """RSD-C: the static builder's level-by-level drafting over a constant-branching shape
    (default: 2 children per node at every depth up to max_depth)."""

    branching: tuple[int, ...] = ()
    name: str = "rsd-c"

    def shape_for(self, budget: int, temperature: float | None = None) -> Shape:
        return branching_shape(budget, tuple(self.branching) or (2,) * self.max_depth)
