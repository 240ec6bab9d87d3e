"""TokenTree: a draft tree as flat tensors (docs/algorithms.md §1).

Conventions (shared by every builder, verifier and the engine):
- node 0 is the root: the last emitted token, not yet in either KV cache; the budget counts non-root nodes;
- nodes are in topological order, parents[i] < i, parents[0] = -1; children of a node appear in the order the
  builder proposed them (the sampling order for builders that sample);
- positions are prefix_len + depth: siblings share a position, never a cache slot (node i uses slot
  prefix_len + i while the tree is being verified).

Does not know: models, caches, probabilities beyond the per-node score the builder chose to keep.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenTree:
    """tokens, parents, depths: long [N+1]; scores: float [N+1] (cumulative draft log-prob, root = 0);
    draft_slots: long [N+1] or None: the draft-cache slot holding each node's K/V, -1 where the draft never
    processed the node (builders that run the draft set it; the engine uses it to commit the draft cache)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    draft_slots: torch.Tensor | None = None

    @classmethod
    def root_only(cls, token: int, device: torch.device | str = "cpu") -> "TokenTree":
        long = dict(dtype=torch.long, device=device)
        return cls(torch.tensor([token], **long), torch.tensor([-1], **long), torch.zeros(1, **long),
                   torch.zeros(1, dtype=torch.float32, device=device))

    @classmethod
    def from_lists(cls, tokens: list[int], parents: list[int], scores: list[float] | None = None,
                   device: torch.device | str = "cpu") -> "TokenTree":
        """Build from python lists (tests, small static trees). parents[0] must be -1, parents[i] < i."""
        if not parents or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
            raise ValueError(f"parents must start with -1 and satisfy 0 <= parents[i] < i, got {parents}")
        depths = [0] * len(parents)
        for i in range(1, len(parents)):
            depths[i] = depths[parents[i]] + 1
        long = dict(dtype=torch.long, device=device)
        sc = torch.tensor(scores if scores is not None else [0.0] * len(tokens), dtype=torch.float32, device=device)
        return cls(torch.tensor(tokens, **long), torch.tensor(parents, **long), torch.tensor(depths, **long), sc)

    @property
    def size(self) -> int:
        """Number of non-root nodes (what the budget counts)."""
        return int(self.tokens.numel()) - 1

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def max_depth(self) -> int:
        return int(self.depths.max())

    def positions(self, prefix_len: int) -> torch.Tensor:
        """RoPE positions [N+1] = prefix_len + depth."""
        return self.depths + prefix_len

    def ancestor_mask(self) -> torch.Tensor:
        """bool [N+1, N+1]: A[i, j] is True iff j is i or an ancestor of i. Pointer doubling: after round r
        every row holds the ancestors less than 2^r levels up, so ceil(log2(N+1)) rounds (a number known from
        the shape) cover any depth, with no host sync."""
        n = self.tokens.numel()
        rows = torch.arange(n, device=self.device)
        mask = torch.zeros(n, n, dtype=torch.bool, device=self.device)
        mask[rows, rows] = True
        jump = self.parents.clone()                      # the 2^r-th ancestor of each node, -1 above the root
        for _ in range(max(n - 1, 0).bit_length()):
            has = (jump >= 0)[:, None]
            mask |= mask[jump.clamp(min=0)] & has
            jump = torch.where(jump >= 0, jump[jump.clamp(min=0)], jump)
        return mask

    def path(self, node: int) -> list[int]:
        """Node indices from the root to `node`, root first."""
        parents = self.parents.tolist()
        out = [node]
        while parents[out[-1]] >= 0:
            out.append(parents[out[-1]])
        return out[::-1]

    def children(self, node: int) -> list[int]:
        """Children of `node` in proposal order."""
        return torch.nonzero(self.parents == node).flatten().tolist()

    def select(self, keep: torch.Tensor, check: bool = True) -> "TokenTree":
        """The sub-tree of nodes `keep` (ascending indices, ancestor-closed, containing 0), parents remapped.
        check=False skips the closure check (a host sync) for callers that guarantee it."""
        remap = torch.full((self.tokens.numel(),), -1, dtype=torch.long, device=self.device)
        remap[keep] = torch.arange(keep.numel(), device=self.device)
        parents = self.parents[keep]
        new_parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        if check and bool((new_parents[1:] < 0).any()):
            raise ValueError("select() needs an ancestor-closed node set")
        slots = None if self.draft_slots is None else self.draft_slots[keep]
        return TokenTree(self.tokens[keep], new_parents, self.depths[keep], self.scores[keep], slots)

    def prune(self, budget: int) -> "TokenTree":
        """Keep the root and the `budget` best-scoring nodes (see best_nodes); node order is preserved."""
        if self.size <= budget:
            return self
        return self.select(best_nodes(self.scores, budget), check=False)


def best_nodes(scores: torch.Tensor, budget: int, n_finite: int | None = None) -> torch.Tensor:
    """The root plus the `budget` best-scoring nodes with a finite score, ascending (ties: earlier nodes).
    scores float [n], root first. When scores never increase along a path the set is ancestor-closed (a tie
    with an ancestor goes to the ancestor, which comes first). n_finite: how many non-root scores are finite,
    when the caller read it already; else this reads it (one host sync)."""
    if n_finite is None:
        n_finite = int(torch.isfinite(scores[1:]).sum())
    order = torch.sort(scores[1:], descending=True, stable=True).indices[:min(budget, n_finite)] + 1
    return torch.cat([order.new_zeros(1), torch.sort(order).values])
