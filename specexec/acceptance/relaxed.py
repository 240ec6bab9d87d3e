"""Relaxed acceptance (--accept relaxed[:delta=D,k=K]): LOSSY by name. LANTERN's latent-proximity rule
(docs/algorithms.md §32) on top of the greedy-match and sample-and-match rules.

At a verified node u with the target's processed distribution p and drafted children x_1..x_c (node order):
walk the children's neighbour lists in that order (each child's k nearest tokens by the cosine of the target's
input embeddings, nearest first), skipping tokens that are children of u themselves and tokens an earlier
sibling listed, and let each child CLAIM its neighbours while the total claimed mass at u stays <= delta (the
first neighbour that does not fit ends the claims at u: the claimed set is a prefix of that walk). The relaxed
distribution p~ moves each claimed token's mass onto its claimer, so TV(p, p~) = claimed mass <= delta at every
node. The target's choice per node is then made under p~ instead of p:
- T = 0 (greedy match): the argmax of p~ (the exact argmax y, unless a claiming child's p + claimed mass beats
  p~(y), which is 0 when y itself was claimed);
- T > 0 (sample-and-match): the exact per-node sample c ~ p, replaced by its claimer when c was claimed (so the
  choice is a draw from p~ given the tree, which the draft built without this step's target draws).
The rest is accept_greedy unchanged. A token counts as relaxed when the relaxed choice at its node differs from
the exact one; the bonus token never does (no child matched there, so nothing was claimed from its choice).

Neighbours are computed where the target's embedding table lives, once per token per model (the first time the
token is drafted; on CUDA the whole table at the first use), and kept for the model's life, in ONE table as wide
as the run's k (its --accept's, else the default: what its plan counts); a request may lower k (the first of
each token's neighbours), never raise it (check_relaxed).

Does not know: models beyond their embedding table, logits processing (probabilities arrive processed), the
engine's loop, which builder drew the tree; rules that divide by the draft's q (rrs_wor) or walk node by node
(rrs): the engine refuses them in relaxed mode (relaxed_rule).
"""
from __future__ import annotations

import torch
from torch import Tensor

from specexec.config import Acceptance, SamplingParams
from specexec.options import RELAXED_K, about
from specexec.tree import TokenTree
from specexec.uploads import upload
from specexec.acceptance.rules import Accepted, accept_greedy

ROW_CHUNK = 16384           # embedding rows compared at once while filling neighbours ([n, 16k] fp32 scores)


def table_k(accept: Acceptance) -> int:
    """The width of a run's one neighbour table: its --accept's k when relaxed, else the default k (what a
    server's request may ask for without the run's --accept saying more)."""
    return accept.k if accept.relaxed else RELAXED_K


def check_relaxed(accept: Acceptance, vocab_size: int, has_builder: bool, verifier: str = "auto",
                  max_k: int | None = None) -> None:
    """ConfigError (one line, about "--accept") when `accept` cannot run here: k must leave the token itself out
    of the vocabulary (k <= V - 1) and stay within the run's neighbour table (max_k: its width, table_k of the
    run's --accept, what its plan counts), something must draft, and the verifier must be one relaxed acceptance
    runs on (auto or sample_match: refused at the start, whatever temperature a later request asks for). Its one
    caller is acceptance/choice.rule_for."""
    if not accept.relaxed:
        return
    if accept.k > vocab_size - 1:
        raise about("--accept", accept.label, f"--accept {accept.label}: k={accept.k} is above the target's "
                    f"vocabulary of {vocab_size} tokens (a token's neighbours leave it out: k <= {vocab_size - 1})")
    if max_k is not None and accept.k > max_k:
        raise about("--accept", accept.label, f"--accept {accept.label}: k={accept.k} is above the {max_k} "
                    f"neighbours per token this run's table holds ({max_k} is what its plan counts; a request may "
                    f"lower k, not raise it): start the run with --accept relaxed:k={accept.k} to allow it")
    if not has_builder:
        raise about("--accept", accept.label, f"--accept {accept.label} relaxes the check of drafted tokens, and "
                    "nothing drafts here (--no-draft): drop one of the two")
    _check_rule(verifier)


def relaxed_rule(verifier: str, sampling: SamplingParams) -> str:
    """The rule relaxed acceptance runs on: greedy at T = 0, sample_match at T > 0 (for every builder: it is exact
    for any tree). ConfigError for a verifier it cannot take."""
    _check_rule(verifier)
    return "greedy" if sampling.greedy else "sample_match"


def _check_rule(verifier: str) -> None:
    if verifier in ("auto", "sample_match"):
        return
    why = {"rrs_wor": "divides by the draft's q, which can amplify the moved mass far past delta",
           "greedy": "is exact at temperature 0 only"}.get(verifier,
                                                            "is equal in law to sample_match on the trees it is exact for")
    raise about("--accept", "relaxed", f"--accept relaxed runs on the greedy and sample_match rules; --verifier "
                f"{verifier} {why}: use --verifier sample_match (or auto)")


class Neighbours:
    """Each token's nearest tokens by cosine similarity of the rows of `embedding` [V, D] (the token itself left
    out), nearest first. ONE int32 table [V, k] on `device` (k: the run's table_k, what its plan counts), made at
    its first use, filled per token on demand and kept; a lookup of fewer neighbours reads the first of them.
    The scores are computed where `embedding` lives (its device), in fp32, ROW_CHUNK rows at a time."""

    def __init__(self, embedding: Tensor, device: torch.device | str, k: int = RELAXED_K) -> None:
        self.embedding, self.device, self.k = embedding, torch.device(device), k
        self.eager = self.device.type == "cuda"          # a GPU fills the whole table at its first use
        self._inv_norms: Tensor | None = None
        self._table_: tuple[Tensor, Tensor, list[bool]] | None = None   # (ids, filled, [complete])

    @property
    def vocab_size(self) -> int:
        return self.embedding.shape[0]

    def bytes_for(self, k: int) -> int:
        """Device bytes a table of width `k` holds once made (table_bytes)."""
        return self.table_bytes(self.vocab_size, k)

    @staticmethod
    def table_bytes(vocab_size: int, k: int) -> int:
        """Device bytes of the table of `k` neighbours per token of a `vocab_size` vocabulary: ids int32 [V, k] +
        filled flags [V] (what the memory plan counts: planning/needs.py)."""
        return vocab_size * (4 * k + 1)

    def lookup(self, tokens: Tensor, k: int) -> Tensor:
        """tokens long [n] -> their k nearest tokens, long [n, k] on `device` (filling the ones not known yet: one
        host sync, none once the table is complete); k <= the table's width."""
        if not 1 <= k <= self.k:
            raise ValueError(f"k={k} neighbours: this table holds {self.k} per token")
        ids, filled, complete = self._table()
        tokens = tokens.to(self.device).long()
        if not complete[0]:
            todo = torch.arange(self.vocab_size, device=self.device) if self.eager else \
                torch.unique(tokens[~filled[tokens]])
            if todo.numel():
                ids[todo] = self._nearest(todo, self.k).to(device=self.device, dtype=torch.int32)
                filled[todo] = True
                complete[0] = bool(filled.all())
        return ids[tokens, :k].long()

    @property
    def made(self) -> int:
        """Device bytes of the table made so far (0 before the first lookup)."""
        return 0 if self._table_ is None else self.bytes_for(self.k)

    def _table(self) -> tuple[Tensor, Tensor, list[bool]]:
        if self._table_ is None:
            if not 1 <= self.k < self.vocab_size:
                raise ValueError(f"k={self.k} neighbours do not fit a vocabulary of {self.vocab_size}")
            self._table_ = (torch.zeros(self.vocab_size, self.k, dtype=torch.int32, device=self.device),
                            torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device), [False])
        return self._table_

    def _norms(self) -> Tensor:
        """1 / |row| of every embedding row [V] fp32 (a zero row scores 0 against everything)."""
        if self._inv_norms is None:
            e = self.embedding
            parts = [e[s:s + ROW_CHUNK].float().norm(dim=1) for s in range(0, e.shape[0], ROW_CHUNK)]
            self._inv_norms = 1.0 / torch.cat(parts).clamp_min(torch.finfo(torch.float32).tiny)
        return self._inv_norms

    def _nearest(self, tokens: Tensor, k: int) -> Tensor:
        """tokens long [n] -> long [n, k]: the top-k cosine scores against every row, the token itself excluded."""
        e, inv = self.embedding, self._norms()
        tokens = tokens.to(e.device)
        out = []
        for q0 in range(0, tokens.numel(), ROW_CHUNK // 16):
            rows = tokens[q0:q0 + ROW_CHUNK // 16]
            q = e[rows].float() * inv[rows, None]
            best_v = torch.empty(rows.numel(), 0, device=e.device)
            best_i = torch.empty(rows.numel(), 0, dtype=torch.long, device=e.device)
            for s in range(0, e.shape[0], ROW_CHUNK):
                score = (q @ e[s:s + ROW_CHUNK].float().T) * inv[None, s:s + ROW_CHUNK]
                own = (rows >= s) & (rows < s + score.shape[1])
                score[own.nonzero()[:, 0], rows[own] - s] = float("-inf")          # never its own neighbour
                v, i = torch.cat([best_v, score], 1), torch.cat([best_i, torch.arange(
                    s, s + score.shape[1], device=e.device).expand(rows.numel(), -1)], 1)
                top = v.topk(min(k, v.shape[1]), dim=1)
                best_v, best_i = top.values, i.gather(1, top.indices)
            out.append(best_i)
        return torch.cat(out)


class Relaxation:
    """One verification under relaxed acceptance: the tree's children grouped by parent with their neighbours
    (built once), then per chunk of the target's rows the claims and the relaxed choices (`choose`), then the
    accepted path with each emitted token's relaxed flag (`accept`)."""

    def __init__(self, tree: TokenTree, neighbours: Neighbours, accept: Acceptance, greedy: bool) -> None:
        self.delta, self.k, self.greedy, self.vocab = accept.delta, accept.k, greedy, neighbours.vocab_size
        dev = tree.device
        parent = tree.parents[1:]
        order = torch.sort(parent, stable=True).indices                  # by parent, node order within one
        self.parent, self.tok = parent[order], tree.tokens[1:][order]    # [c]: the children, grouped
        c = self.parent.numel()
        first = torch.searchsorted(self.parent, self.parent)
        self.rank = torch.arange(c, device=dev) - first                  # place among its siblings
        self.nb = neighbours.lookup(self.tok, self.k) if c else torch.zeros(0, self.k, dtype=torch.long, device=dev)
        self.width = int(self.rank.max()) + 1 if c else 0                # most children of one node (a host sync)
        self.ok = self._claimable()
        self.exact: list[Tensor] = []                                    # the exact choice of each chunk

    def _claimable(self) -> Tensor:
        """bool [c, k]: neighbour j of child i may be claimed: not a child of the same node, and not listed by an
        earlier sibling (the first listing wins; within a list, the nearer entry)."""
        if not self.parent.numel():
            return torch.zeros_like(self.nb, dtype=torch.bool)
        key = self.parent[:, None] * self.vocab + self.nb                       # (node, token) pairs
        sibling = torch.isin(key, self.parent * self.vocab + self.tok)
        col = (self.rank[:, None] * self.k + torch.arange(self.k, device=key.device)).reshape(-1)
        order = torch.argsort(key.reshape(-1) * (col.numel() + 1) + col)   # by pair, then walk order
        pair = key.reshape(-1)[order]
        lead = torch.ones_like(pair, dtype=torch.bool)
        lead[1:] = pair[1:] != pair[:-1]                                    # the pair's first listing
        first = torch.empty_like(lead).scatter_(0, order, lead)            # (sorted, not unique(): no host sync)
        return ~sibling & first.view_as(key)

    def _claims(self, p: Tensor, start: int) -> tuple[Tensor, Tensor, Tensor]:
        """p [R, V] at nodes start..start+R-1 -> (the node row of every child [c], clamped into the chunk, the
        mass each moves onto itself fp64 [c], which neighbours it claimed bool [c, k]); a child whose parent is
        outside the chunk moves and claims nothing. No host sync: every child is kept, masked, not sliced."""
        R = p.shape[0]
        inside = (self.parent >= start) & (self.parent < start + R)
        rows = torch.where(inside, self.parent - start, R)                # outside: a spare walk row R
        mass = p[rows.clamp(max=R - 1)[:, None], self.nb].double()
        mass = torch.where(self.ok & inside[:, None] & (mass > 0), mass, 0.0)
        cols = self.rank[:, None] * self.k + torch.arange(self.k, device=p.device)
        walk = torch.zeros(R + 1, max(self.width, 1) * self.k, dtype=torch.float64, device=p.device)
        walk[rows[:, None], cols] = mass                                  # (row R: zeros only)
        running = walk.cumsum(1)[rows[:, None], cols]                     # claimed so far at the node, in walk order
        took = (mass > 0) & (running <= self.delta)
        return rows.clamp(max=R - 1), (mass * took).sum(1), took

    def choose(self, start: int, logp: Tensor, exact: Tensor) -> Tensor:
        """The relaxed choice at nodes start.. [R] from their processed log-probabilities [R, V] and the exact
        choice there (the argmax at T = 0, one target sample per node at T > 0); the exact choice is kept."""
        self.exact.append(exact)
        p = logp.exp()
        if not self.parent.numel():
            return exact
        rows, moved, took = self._claims(p, start)       # a child outside the chunk: moved 0, took nothing
        tok, nb, m, none = self.tok, self.nb, rows.numel(), torch.zeros_like(exact)
        if not self.greedy:                          # the sample's claimer replaces it (at most one per node)
            hit = (took & (nb == exact[rows][:, None])).any(1)
            who = torch.full_like(exact, -1).scatter_reduce(0, rows, torch.where(hit, torch.arange(
                m, device=rows.device), -1), "amax")                    # no boolean-mask indexing: no host sync
            return torch.where(who >= 0, tok[who.clamp(min=0)].to(exact.dtype), exact)
        p = p.double()
        lifted = torch.where(moved > 0, p[rows, tok] + moved, -1.0)         # p~ of each child that claimed
        y = exact[rows]
        y_gone = (took & (nb == y[:, None])).any(1)                     # the exact argmax was claimed
        p_y = p.gather(1, exact[:, None])[:, 0]
        p_y = torch.where(none.scatter_reduce(0, rows, y_gone.long(), "amax") > 0, 0.0, p_y)
        y_up = (moved > 0) & (tok == y)                                 # (at most one child per node: y itself)
        up = torch.full_like(p_y, -1.0).scatter_reduce(0, rows, torch.where(y_up, lifted, -1.0), "amax")
        p_y = torch.where(none.scatter_reduce(0, rows, y_up.long(), "amax") > 0, up, p_y)
        best = torch.full_like(p_y, -1.0).scatter_reduce(0, rows, lifted, "amax")
        wins = (lifted == best[rows]) & (lifted > p_y[rows])
        pos = torch.where(wins, torch.arange(m, device=rows.device), m)
        first = torch.full_like(exact, m).scatter_reduce(0, rows, pos, "amin")   # earliest winner
        return torch.where(first < m, tok[first.clamp(max=m - 1)].to(exact.dtype), exact)

    def accept(self, tree: TokenTree, choices: Tensor) -> Accepted:
        """accept_greedy on the relaxed choices [N+1], with `relaxed`: per emitted token whether it differs from
        the exact choice at its node."""
        acc = accept_greedy(tree, choices)
        differs = (choices.to(tree.device) != torch.cat(self.exact).to(tree.device))
        acc.relaxed = tuple(differs[upload(acc.nodes, tree.device)].tolist())
        return acc
