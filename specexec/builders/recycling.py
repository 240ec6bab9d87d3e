"""Token Recycling builder: no draft model; the target's own discarded top-k candidates become the drafts.

Luo et al., "Turning Trash into Treasure: Accelerating Inference of Large Language Models with Token
Recycling" (ACL'25, arXiv 2408.08696); docs/algorithms.md §13.
- State: an adjacency matrix M [V, k] (default k = 8): row t holds the target's top-k next tokens the last
  time token t was verified (-1: never seen). It lives as long as the builder (hot start across prompts).
- Template: a static tree of child ranks (root -> rank-r candidate -> ...). It is Sequoia's DP shape
  (static.tree_shape) for the budget over a rank-acceptance profile typical of recycled candidates, depth <= 6,
  at most k children per node: at budget 80 it has levels 8/23/25/17/6/1 (the paper's template: 8/21/25/15/8/3).
- Drafting: one gather per level, tok[child] = M[tok[parent], rank[child]]; nodes whose row is empty (and
  their subtrees) are dropped. No model call, one host sync per tree.
- Learning: the engine hands `observe_target(tree, topk)` the target's top-k at every verified node (opt-in
  through `observe_topk`); every node's row is overwritten (duplicates: the last write wins).
Children of a node are distinct (a row is one top-k) and fixed before the target sees this tree, so the tree
is "deterministic": greedy, sample-and-match and EAGLE-style rejection (rrs) are exact.

Does not know: the target model (only the top-k ids it is handed), verification, draft models.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specexec.config import SamplingParams
from specexec.tree import TokenTree
from specexec.uploads import upload
from specexec.builders.static import Shape, tree_shape
from specexec.builders.registry import register

RANK_ACCEPTANCE = (0.45, 0.15, 0.08, 0.05, 0.035, 0.025, 0.02, 0.015)


@register
@dataclass
class RecyclingBuilder:
    k: int = 8
    max_depth: int = 6
    name: str = "recycling"
    drafting: str = "deterministic"
    needs_draft: bool = False
    adjacency: Tensor | None = None          # long [V, k], -1 = never observed
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def observe_topk(self) -> int:
        """The engine computes the target's top-k ids at every verified node and calls observe_target."""
        return self.k

    def bind(self, vocab_size: int, device: torch.device | str) -> None:
        """Allocate the adjacency matrix (kept if it already fits: hot start)."""
        a = self.adjacency
        if a is None or a.shape[0] != vocab_size or a.device != torch.device(device):
            self.adjacency = torch.full((vocab_size, self.k), -1, dtype=torch.long, device=device)

    def template(self, budget: int) -> Shape:
        return tree_shape(budget, self.max_depth, RANK_ACCEPTANCE[: self.k] + (0.01,) * (self.k - 8))

    def _layout(self, budget: int, device: torch.device
                ) -> tuple[Shape, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
        """Template tensors (parents, ranks, depths [N+1], log values [N+1]) and each level's node indices, cached
        per budget (uploaded once)."""
        key = (budget, str(device))
        if key not in self._cache:
            shape = self.template(budget)
            ranks = [i - shape.first[p] if p >= 0 else 0 for i, p in enumerate(shape.parents)]
            levels = [[i for i, d in enumerate(shape.depths) if d == depth]
                      for depth in range(1, max(shape.depths) + 1)]
            tensors = [upload(x, device) for x in (shape.parents, ranks, shape.depths)]
            tensors.append(upload(shape.log_value, device, torch.float32))
            self._cache[key] = (shape, *tensors, [upload(level, device) for level in levels])
        return self._cache[key]

    def build(self, draft, root_token: int, budget: int, sampling: SamplingParams,
              rng: torch.Generator | None = None) -> TokenTree:
        """Fill the template from the adjacency matrix, level by level (one gather each)."""
        if self.adjacency is None:
            raise RuntimeError("RecyclingBuilder.bind(vocab_size, device) must run before build()")
        M = self.adjacency
        shape, parents, ranks, depths, values, levels = self._layout(budget, M.device)
        tokens = torch.full((len(shape.parents),), -1, dtype=torch.long, device=M.device)
        tokens[0] = root_token
        for level in levels:
            ptok = tokens[parents[level]]
            tokens[level] = torch.where(ptok >= 0, M[ptok.clamp(min=0), ranks[level]], -1)
        full = TokenTree(tokens.clamp(min=0), parents, depths, values)
        return full.select(torch.nonzero(tokens >= 0).flatten())        # one host sync per tree

    def observe_target(self, tree: TokenTree, topk: Tensor) -> None:
        """topk long [N+1, >= k]: the target's top ids after each node; they overwrite the nodes' rows."""
        self.adjacency[tree.tokens] = topk[:, : self.k].to(self.adjacency.device)

    def observe(self, tree: TokenTree, accepted_nodes: list[int], bonus: int) -> None:
        """Learning happens in observe_target (it needs the target's top-k, not just the accepted path)."""

    def kv_slots(self, budget: int) -> int:
        return 0
