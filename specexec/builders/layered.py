"""What every layer-by-layer builder shares: draft passes that reuse the draft KV cache, the growing tree, and
child selection (top-k, or a sample without replacement in draw order).

- `ModelPasses` runs the draft for one tree: a root pass that feeds the pending tokens (accepted tokens the
  draft never saw, ending with the root) and commits all but the root, then one batched pass per call to
  `expand()` over nodes whose parents were already processed. Every node is computed once; each attends to
  the cached prefix and the cached K/V of its processed ancestors (an ancestor matrix over processed nodes,
  grown row by row, as in the SpecExec builder). Processed node j lives at draft-cache slot L0 + j, which
  `slots()` reports so `DraftState.commit` keeps the accepted ones.
- A toy draft (tests) implements the same three calls on a Markov table, so the statistical tests drive the
  real tree-construction code without a model (`draft_passes` picks the implementation).
- `Growth` is the tree under construction as flat tensors; `pick_children` chooses each expanded node's
  children: its top-k at temperature 0, else Gumbel-top-k of the processed draft distribution (a sample
  without replacement, listed in draw order: ALGORITHMS.md §0.4), so V5 (rrs_wor) is exact.
- `QStore` keeps the processed draft log-probabilities of every processed node of the last tree, for
  builders verified with rrs_wor (`draft_probs(tree, node)`).

Does not know: the target model, verification, which nodes a builder expands or keeps.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ..config import SamplingParams
from ..sampling import gumbel_topk, process_logits
from ..tree import TokenTree
from .base import DraftState


class Passes(Protocol):
    """One tree's draft passes (see the module docstring). Processed index 0 is the root."""

    n_proc: int
    capacity: int

    def root(self, root_token: int) -> Tensor:
        """Processed draft log-probs [1, V] after the root."""

    def expand(self, tokens: Tensor, depths: Tensor, parent_proc: Tensor) -> Tensor:
        """tokens, depths, parent_proc long [b] -> processed log-probs [b, V]; the nodes get processed
        indices n_proc .. n_proc + b - 1 (in this order)."""

    def slots(self, proc: Tensor) -> Tensor | None:
        """Draft-cache slot per processed index (proc long [N+1], -1 kept as -1), or None (no cache)."""


class ModelPasses:
    """Passes over a DraftState's model and KV cache; at most `capacity` processed nodes (root included)."""

    def __init__(self, draft: DraftState, capacity: int, sampling: SamplingParams) -> None:
        self.draft, self.capacity, self.sampling = draft, capacity, sampling
        self.device = draft.cache.k.device
        self.anc = torch.zeros(capacity, capacity, dtype=torch.bool, device=self.device)
        self.n_proc, self.L0 = 0, draft.cache.length

    def root(self, root_token: int) -> Tensor:
        """Feed the pending tokens (ending with the root) in one causal pass; commit all but the root."""
        draft, dev = self.draft, self.device
        pending = draft.pending if draft.pending and draft.pending[-1] == root_token else [root_token]
        L, P = draft.cache.length, len(pending)
        slots = torch.arange(L, L + P, device=dev)
        mask = torch.cat([torch.ones(P, L, dtype=torch.bool, device=dev),
                          torch.ones(P, P, dtype=torch.bool, device=dev).tril()], dim=1)
        logits = draft.forward(torch.tensor(pending, device=dev), slots, mask, slots)[-1:]
        draft.cache.keep(slots[:-1])
        draft.pending = [root_token]
        self.L0, self.n_proc = draft.cache.length, 1
        self.anc[0, 0] = True
        return process_logits(logits, self.sampling)

    def expand(self, tokens: Tensor, depths: Tensor, parent_proc: Tensor) -> Tensor:
        b, n = tokens.numel(), self.n_proc
        if n + b > self.capacity:
            raise RuntimeError(f"draft pass over {b} nodes exceeds the tree's {self.capacity} draft slots")
        new = torch.arange(n, n + b, device=self.device)
        self.anc[new] = self.anc[parent_proc]
        self.anc[new, new] = True
        mask = torch.cat([torch.ones(b, self.L0, dtype=torch.bool, device=self.device), self.anc[new, :n + b]], 1)
        logits = self.draft.forward(tokens, self.L0 + depths, mask, self.L0 + new)
        self.n_proc = n + b
        return process_logits(logits, self.sampling)

    def slots(self, proc: Tensor) -> Tensor:
        return torch.where(proc >= 0, proc + self.L0, proc)


def draft_passes(draft: object, capacity: int, sampling: SamplingParams) -> Passes:
    """ModelPasses for a DraftState; a toy draft (tests) supplies its own through `.passes(...)`."""
    if draft is None:
        raise ValueError("this builder needs a draft model")
    if isinstance(draft, DraftState):
        return ModelPasses(draft, capacity, sampling)
    return draft.passes(capacity, sampling)                        # type: ignore[attr-defined]


@dataclass
class Growth:
    """The tree under construction (buffer order is topological): long tokens/parents/depths/proc [n],
    float scores [n] (cumulative draft log-prob or another non-increasing value); proc = processed index."""

    tokens: Tensor
    parents: Tensor
    depths: Tensor
    scores: Tensor
    proc: Tensor

    @classmethod
    def start(cls, root_token: int, device: torch.device) -> "Growth":
        long = dict(dtype=torch.long, device=device)
        return cls(torch.tensor([root_token], **long), torch.tensor([-1], **long), torch.zeros(1, **long),
                   torch.zeros(1, device=device), torch.zeros(1, **long))

    @property
    def n(self) -> int:
        return self.tokens.numel()

    def add(self, tokens: Tensor, parents: Tensor, scores: Tensor) -> Tensor:
        """Append nodes (tokens, parents long [k], scores float [k]); returns their indices [k]."""
        k, first = tokens.numel(), self.n
        self.tokens = torch.cat([self.tokens, tokens])
        self.parents = torch.cat([self.parents, parents])
        self.depths = torch.cat([self.depths, self.depths[parents] + 1])
        self.scores = torch.cat([self.scores, scores.float()])
        self.proc = torch.cat([self.proc, torch.full((k,), -1, dtype=torch.long, device=tokens.device)])
        return torch.arange(first, first + k, device=tokens.device)

    def expand(self, passes: Passes, nodes: Tensor) -> Tensor:
        """One draft pass over `nodes` [b] (their parents processed): processed log-probs [b, V]."""
        first = passes.n_proc
        logq = passes.expand(self.tokens[nodes], self.depths[nodes], self.proc[self.parents[nodes]])
        self.proc[nodes] = torch.arange(first, first + nodes.numel(), device=nodes.device)
        return logq

    def tree(self, passes: Passes | None, keep: Tensor | None = None) -> TokenTree:
        """The TokenTree of all nodes, or of `keep` (ascending, ancestor-closed, with the root)."""
        slots = passes.slots(self.proc) if passes is not None else None
        full = TokenTree(self.tokens, self.parents, self.depths, self.scores, slots)
        return full if keep is None else full.select(keep)


def pick_children(logq: Tensor, counts: Tensor | int, sample: bool, rng: torch.Generator | None,
                  max_count: int | None = None, keep_all: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Children of b expanded nodes: logq [b, V] processed log-probs; counts long [b] (or one int) children
    each (max_count: their maximum, when the caller knows it without a host sync). sample=False: the top-k;
    True: Gumbel-top-k, a sample without replacement listed in draw order (ALGORITHMS.md §0.4).

    Returns (row, rank, token long [c], logp float [c]) grouped by row in proposal order (rank = position
    among the row's children). Zero-probability tokens and ranks beyond a row's count are dropped (one host
    sync), or with keep_all=True kept as token 0 / logp -inf (c = b * k, no host sync)."""
    b, dev = logq.shape[0], logq.device
    per_row = isinstance(counts, Tensor)
    k = max_count if max_count is not None else (int(counts.max()) if per_row else counts)
    k = min(int(k), logq.shape[-1])
    if k <= 0 or b == 0:
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        return empty, empty, empty, logq.new_zeros(0)
    if sample:
        tok, keys = gumbel_topk(logq, k, rng)                       # tail of a short support: -1 / -inf
        ok = torch.isfinite(keys)
        top_lp = logq.gather(1, tok.clamp(min=0))
    else:
        top_lp, tok = logq.topk(k, dim=-1)
        ok = torch.isfinite(top_lp)
    if per_row:
        ok &= torch.arange(k, device=dev)[None] < counts.to(dev)[:, None]
    if keep_all:
        flat = torch.arange(b * k, device=dev)
        return flat // k, flat % k, tok.clamp(min=0).flatten(), top_lp.masked_fill(~ok, float("-inf")).flatten()
    idx = ok.flatten().nonzero().squeeze(1)                          # the one host sync
    return idx // k, idx % k, tok.flatten()[idx], top_lp.flatten()[idx]


def kth_best(scores: Tensor, k: int) -> Tensor:
    """The k-th best of the non-root scores [n] (scores[0] is the root's), -inf while fewer exist."""
    if scores.numel() - 1 < k:
        return scores.new_tensor(float("-inf"))
    return scores[1:].topk(k).values[-1]


def best_nodes(g: Growth, budget: int) -> Tensor:
    """The root plus the `budget` best-scoring nodes with a finite score, ascending (ties: earlier nodes).
    Scores never increase along a path, so the set is ancestor-closed. One host sync."""
    order = torch.sort(g.scores[1:], descending=True, stable=True).indices[:budget] + 1
    order = order[torch.isfinite(g.scores[order])]
    return torch.cat([order.new_zeros(1), torch.sort(order).values])


class QStore:
    """Processed draft log-probs of the last tree's processed nodes (one [b, V] tensor per pass, not copied),
    so `probs(tree, node)` can hand rrs_wor the q the children were drawn from."""

    def __init__(self) -> None:
        self.parts: list[Tensor] = []
        self.starts: list[int] = []
        self.L0, self.keep = 0, True

    def reset(self, first: Tensor, keep: bool = True) -> None:
        """Start a tree with the root pass's log-probs; keep=False (temperature 0: no rule asks for q) holds
        nothing, so the passes' [b, V] tensors are freed as usual."""
        self.keep = keep
        self.parts, self.starts = ([first], [0]) if keep else ([], [])

    def add(self, logq: Tensor) -> None:
        if self.keep:
            self.starts.append(self.starts[-1] + self.parts[-1].shape[0])
            self.parts.append(logq)

    def set_base(self, passes: Passes) -> None:
        """Remember how processed indices map to tree.draft_slots (slot = base + processed index)."""
        base = passes.slots(torch.zeros(1, dtype=torch.long))
        self.L0 = 0 if base is None else int(base[0])

    def probs(self, tree: TokenTree, node: int) -> Tensor:
        """q [V] at `node` of the last tree built (the node must have been processed)."""
        if not self.parts:
            raise ValueError("no draft distributions were kept for this tree (built at temperature 0)")
        if tree.draft_slots is None or int(tree.draft_slots[node]) < 0:
            raise ValueError(f"node {node} was never processed by the draft: no draft distribution there")
        proc = int(tree.draft_slots[node]) - self.L0
        part = bisect.bisect_right(self.starts, proc) - 1
        return self.parts[part][proc - self.starts[part]].exp()
