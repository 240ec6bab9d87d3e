"""SpecExec tree builder: best-first growth of the most probable continuations under a node budget.

Svirschevski et al., NeurIPS'24 (arXiv 2406.02532); ALGORITHMS.md §7. Each draft pass expands up to B frontier
nodes (top-w children each, score = cumulative draft log-prob + depth * log(decay)); the tree keeps the `budget`
best-scoring nodes. Scores fall strictly along a path, so "best K" is always ancestor-closed.

Made cheap where the reference code is slow:
1. the draft's KV cache is reused: each pass computes only the newly expanded nodes, attending to the cached
   prefix and the cached K/V of their processed ancestors (the ancestor matrix grows row by row);
2. the expansion batch is sized to the budget (B <= budget), and the processed-node count is capped at budget+1;
3. growth stops as soon as no unexpanded node can still place a child in the top `budget`
   (a child scores at most parent + log(decay));
4. one host synchronisation per draft pass (to pick the next frontier), none per node.

Children of a node are distinct tokens (top-w), so the tree is "deterministic" drafting: exact verification
rules are greedy match, sample-and-match (the paper's) and EAGLE-style rejection (verify.py).

Does not know: the target model, verification, sampling beyond the draft's processed distribution.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..sampling import process_logits
from ..tree import TokenTree
from .base import DraftState


@dataclass
class _Growth:
    """The growing tree as flat buffers (buffer index order is topological)."""

    tokens: torch.Tensor      # long [n]
    parents: torch.Tensor     # long [n]
    depths: torch.Tensor      # long [n]
    scores: torch.Tensor      # float [n]
    alive: torch.Tensor       # bool [n]: currently among the best `budget` (root always)
    proc: torch.Tensor        # long [n]: processed-slot index, -1 if never expanded

    def append(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> None:
        k = tokens.numel()
        self.tokens = torch.cat([self.tokens, tokens])
        self.parents = torch.cat([self.parents, parents])
        self.depths = torch.cat([self.depths, self.depths[parents] + 1])
        self.scores = torch.cat([self.scores, scores])
        self.alive = torch.cat([self.alive, torch.ones(k, dtype=torch.bool, device=tokens.device)])
        self.proc = torch.cat([self.proc, torch.full((k,), -1, dtype=torch.long, device=tokens.device)])


def processed_capacity(budget: int) -> int:
    """Draft KV slots one tree may use: the root plus up to 2 x budget expanded nodes (some expanded nodes
    drop out of the best `budget` when better ones appear)."""
    return 2 * budget + 1


@dataclass
class SpecExecBuilder:
    """Paper defaults: 128 beams per pass, top-32 children, at most 32 draft passes, depth decay 0.95."""

    max_beams: int = 128
    max_branch: int = 32
    max_passes: int = 32
    decay: float = 0.95
    beam_fraction: int = 8          # expand at most budget / beam_fraction nodes per pass (>= 1): a narrow
                                    # frontier grows deeper trees per draft FLOP (measured on the Qwen pair)
    name: str = "specexec"
    drafting: str = "deterministic"
    needs_draft: bool = True

    def build(self, draft: DraftState | None, root_token: int, budget: int, sampling: SamplingParams,
              rng: torch.Generator | None = None) -> TokenTree:
        """Grow a tree of at most `budget` non-root nodes under `root_token` (see the module docstring)."""
        assert draft is not None, "the specexec builder needs a draft model"
        log_decay = math.log(self.decay)
        logq, L0 = self._root_pass(draft, root_token, sampling)
        dev = logq.device
        g = _Growth(torch.tensor([root_token], device=dev), torch.tensor([-1], device=dev),
                    torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(1, device=dev),
                    torch.ones(1, dtype=torch.bool, device=dev), torch.zeros(1, dtype=torch.long, device=dev))
        cap = processed_capacity(budget)                    # processed nodes (draft KV slots) per tree
        beams = max(1, min(self.max_beams, budget // self.beam_fraction))
        anc = torch.zeros(cap, cap, dtype=torch.bool, device=dev)
        anc[0, 0] = True
        n_proc, frontier = 1, torch.zeros(1, dtype=torch.long, device=dev)
        for _ in range(self.max_passes - 1):
            threshold = self._add_children(g, frontier, logq, budget, log_decay)
            frontier = self._next_frontier(g, threshold, log_decay, min(beams, cap - n_proc))
            if frontier.numel() == 0:
                break
            logq = self._expand(draft, g, frontier, anc, n_proc, L0, sampling)
            n_proc += frontier.numel()
        else:
            self._add_children(g, frontier, logq, budget, log_decay)
        return self._finish(g, L0)

    def _root_pass(self, draft: DraftState, root_token: int, sampling: SamplingParams) -> tuple[torch.Tensor, int]:
        """Feed the pending tokens (ending with the root) in one causal pass; commit all but the root."""
        pending = draft.pending if draft.pending and draft.pending[-1] == root_token else [root_token]
        cache, dev = draft.cache, draft.cache.k.device
        L, P = cache.length, len(pending)
        slots = torch.arange(L, L + P, device=dev)
        mask = torch.cat([torch.ones(P, L, dtype=torch.bool, device=dev),
                          torch.ones(P, P, dtype=torch.bool, device=dev).tril()], dim=1)
        logits = draft.forward(torch.tensor(pending, device=dev), slots, mask, slots)[-1:]
        cache.keep(slots[:-1])
        draft.pending = [root_token]
        return process_logits(logits, sampling), cache.length

    def _add_children(self, g: _Growth, frontier: torch.Tensor, logq: torch.Tensor, budget: int,
                      log_decay: float) -> torch.Tensor:
        """Top-w children of each frontier node; keep the best `budget` of old+new. Returns the K-th best score
        (-inf while fewer than `budget` nodes exist)."""
        w = min(self.max_branch, budget, logq.shape[-1])
        top_lp, top_tok = logq.topk(w, dim=-1)                                  # [b, w]
        child_scores = (g.scores[frontier, None] + top_lp + log_decay).flatten()
        child_parents = frontier[:, None].expand(-1, w).flatten()
        ok = torch.isfinite(child_scores)
        child_scores, child_parents, child_tokens = child_scores[ok], child_parents[ok], top_tok.flatten()[ok]
        old = torch.nonzero(g.alive[1:]).flatten() + 1
        pool = torch.cat([g.scores[old], child_scores])
        k = min(budget, pool.numel())
        best = pool.topk(k).indices
        keep = torch.zeros(pool.numel(), dtype=torch.bool, device=pool.device)
        keep[best] = True
        g.alive[old] = keep[: old.numel()]
        new = keep[old.numel():]
        g.append(child_tokens[new], child_parents[new], child_scores[new])
        return pool[best].min() if k == budget else pool.new_tensor(float("-inf"))

    def _next_frontier(self, g: _Growth, threshold: torch.Tensor, log_decay: float, limit: int) -> torch.Tensor:
        """Unexpanded live nodes whose best possible child could still enter the budget, best first."""
        if limit <= 0:
            return g.proc.new_zeros(0)
        can = g.alive & (g.proc < 0) & (g.scores + log_decay > threshold)
        idx = torch.nonzero(can).flatten()                                      # the one host sync per pass
        if idx.numel() > limit:
            idx = idx[g.scores[idx].topk(limit).indices]
        return idx

    def _expand(self, draft: DraftState, g: _Growth, frontier: torch.Tensor, anc: torch.Tensor, n_proc: int,
                L0: int, sampling: SamplingParams) -> torch.Tensor:
        """One draft pass over the frontier nodes: each attends to the prefix and its processed ancestors."""
        b = frontier.numel()
        new = torch.arange(n_proc, n_proc + b, device=frontier.device)
        anc[new] = anc[g.proc[g.parents[frontier]]]
        anc[new, new] = True
        g.proc[frontier] = new
        S = L0 + n_proc + b
        mask = torch.cat([torch.ones(b, L0, dtype=torch.bool, device=anc.device), anc[new, : n_proc + b]], dim=1)
        logits = draft.forward(g.tokens[frontier], L0 + g.depths[frontier], mask, L0 + new)
        assert mask.shape[1] == S
        return process_logits(logits, sampling)

    def _finish(self, g: _Growth, L0: int) -> TokenTree:
        keep = torch.nonzero(g.alive).flatten()
        slots = torch.where(g.proc >= 0, g.proc + L0, g.proc)
        full = TokenTree(g.tokens, g.parents, g.depths, g.scores, slots)
        return full.select(keep)

    def observe(self, tree: TokenTree, accepted_nodes: list[int], bonus: int) -> None:
        """SpecExec learns nothing from the target."""

    def kv_slots(self, budget: int) -> int:
        return processed_capacity(budget)
