"""A synthetic streamed mixture-of-experts for `specexec bench moe --synthetic`: draft trees, acceptance and
routing drawn from a stated model and priced by a stated cost model, so the trim policies of
specexec/companions/experts.py can be compared at equal predicted pass time on a CPU in seconds.

The model (every number a World field, printed with the results):
- tokens: a Zipf(`zipf`) vocabulary of `vocab` ids (common tokens recur across branches and steps);
- the draft: each node proposes `children` distinct tokens (drawn by the Zipf law) with probabilities q from
  a sorted Dirichlet(`peak`), or on a hard step (probability `hard`: text the draft predicts badly) of
  `peak_hard`; a tree of budget B is grown best-first by cumulative log q (SpecExec's order)
  and its node scores are those log-probabilities;
- the target: at a node it continues with child i with probability q_i (a calibrated draft), and the step
  accepts while the continuation is a kept node (greedy walk; then one bonus token);
- routing: sparse layer l routes a row of token t to its token's own k experts with probability alpha_l
  (falling linearly from `alpha_first` to `alpha_last` with depth: early layers follow the token), otherwise to
  k experts drawn from the layer's Zipf(`expert_zipf`) popularity;
- cost: a pass costs `base_s` plus `expert_s` per distinct expert per sparse layer (nothing is held on the
  device), a step also the draft's `draft_s_per_node` per grown node.

Does not know: real models or devices; the policies themselves (ExpertPasses trims, this only draws and prices).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass

import torch

from specexec.config import ModelArgs, MoEArgs
from specexec.network.moe import RoutingLog
from specexec.tree import TokenTree


@dataclass(frozen=True)
class World:
    vocab: int = 4000
    zipf: float = 1.1
    children: int = 8
    peak: float = 0.35
    peak_hard: float = 0.35         # a step is hard (this peak) with probability `hard`, else easy (`peak`)
    hard: float = 0.0
    layers: int = 8
    experts: int = 128
    top_k: int = 8
    alpha_first: float = 0.9
    alpha_last: float = 0.2
    expert_zipf: float = 0.6
    base_s: float = 0.05
    expert_s: float = 0.0125        # per distinct expert per sparse layer (94 layers x 10.6 MB / 25 GB/s / 8)
    draft_s_per_node: float = 0.0005
    seed: int = 0

    def to_json(self) -> dict:
        return asdict(self)

    def args(self) -> ModelArgs:
        """A ModelArgs whose every layer is sparse with these experts (what ExpertPasses needs to know)."""
        return ModelArgs(family="qwen3_moe", dim=64, n_layers=self.layers, n_heads=4, n_kv_heads=2, head_dim=16,
                         intermediate_size=64, vocab_size=self.vocab,
                         moe=MoEArgs(n_experts=self.experts, top_k=self.top_k, expert_dim=16))


class WorldRun:
    """Draws trees, routing and acceptance of one World (see the module docstring), seeded."""

    def __init__(self, world: World) -> None:
        self.w = world
        self.g = torch.Generator().manual_seed(world.seed)
        ranks = torch.arange(1, world.vocab + 1, dtype=torch.float64)
        self.token_p = ranks ** -world.zipf / (ranks ** -world.zipf).sum()
        er = torch.arange(1, world.experts + 1, dtype=torch.float64)
        pop = er ** -world.expert_zipf
        self.expert_p = torch.stack([pop[torch.randperm(world.experts, generator=self.g)] for _ in range(world.layers)])
        self.table = torch.stack([torch.multinomial(self.expert_p[l].expand(world.vocab, -1), world.top_k,
                                                    generator=self.g) for l in range(world.layers)], dim=1)
        self.alpha = torch.linspace(world.alpha_first, world.alpha_last, world.layers)
        self.root = 0

    def _children(self) -> tuple[list[int], list[float]]:
        w = self.w
        q = torch.sort(torch._sample_dirichlet(torch.full((w.children,), self.peak, dtype=torch.float64),
                                               generator=self.g), descending=True).values
        tokens = torch.multinomial(self.token_p, w.children, generator=self.g).tolist()
        return tokens, q.tolist()

    def grow(self, budget: int) -> tuple[TokenTree, list[list[float]], list[list[int]]]:
        """A best-first tree of `budget` nodes under the current root: (tree, each node's children's q, each
        node's children's indices in the tree or -1 when not grown)."""
        hard = float(torch.rand((), generator=self.g)) < self.w.hard
        self.peak = self.w.peak_hard if hard else self.w.peak
        tokens, parents, scores = [self.root], [-1], [0.0]
        kid_q, kid_at = [], []
        heap: list[tuple[float, int, int, int]] = []

        def expand(node: int) -> None:
            toks, q = self._children()
            kid_q.append(q)
            kid_at.append([-1] * len(q))
            for i, (t, p) in enumerate(zip(toks, q)):
                heapq.heappush(heap, (-(scores[node] + math.log(p)), node, i, t))

        expand(0)
        while len(tokens) <= budget and heap:
            neg, parent, i, t = heapq.heappop(heap)
            kid_at[parent][i] = len(tokens)
            tokens.append(t)
            parents.append(parent)
            scores.append(-neg)
            expand(len(tokens) - 1)
        tree = TokenTree.from_lists(tokens, parents, scores)
        return tree, kid_q, kid_at

    def routing(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N, L, k] the routing of rows of these tokens."""
        w, N = self.w, tokens.numel()
        own = self.table[tokens]                                                       # [N, L, k]
        fresh = torch.stack([torch.multinomial(self.expert_p[l].expand(N, -1), w.top_k, generator=self.g)
                             for l in range(w.layers)], dim=1)
        follow = torch.rand(N, w.layers, 1, generator=self.g) < self.alpha[None, :, None]
        return torch.where(follow, own, fresh)

    def accept(self, tree: TokenTree, kid_q: list[list[float]], kid_at: list[list[int]], kept: torch.Tensor
               ) -> list[int]:
        """The accepted nodes (root first) of the kept sub-tree (indices of the grown tree) and the new root."""
        keep = set(kept.tolist())
        node, path = 0, [0]
        while node < len(kid_q):
            i = int(torch.multinomial(torch.tensor(kid_q[node] + [max(1 - sum(kid_q[node]), 0.0)]), 1,
                                      generator=self.g))
            nxt = kid_at[node][i] if i < len(kid_at[node]) else -1
            if nxt < 0 or nxt not in keep:
                break
            node = nxt
            path.append(node)
        self.root = int(torch.multinomial(self.token_p, 1, generator=self.g))       # the bonus token
        return path

    def pass_seconds(self, routing: torch.Tensor) -> float:
        """What verifying rows of this routing [K, L, k] costs: base + expert_s per distinct expert per layer."""
        distinct = sum(torch.unique(routing[:, l]).numel() for l in range(self.w.layers))
        return self.w.base_s + self.w.expert_s * distinct


class FakeTarget:
    """What ExpertPasses reads from a target: its routing log (filled by the harness after each pass)."""

    def __init__(self) -> None:
        self.routing = RoutingLog()
