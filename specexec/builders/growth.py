"""The one growth core every draft-grown tree builder uses: draft passes over fixed-size device buffers, the
tree under construction, child selection, and at most ONE host synchronisation per draft pass.

- `DraftPasses` runs the draft for one tree (`FedPasses` a drafter's: each row also reads a state, the target's
  for the pending tokens, its own output at the parent below the root). `root()` feeds the pending tokens
  (accepted tokens the draft never saw, ending with the root) and commits all but the root; each `expand()` is
  one batched pass over nodes whose parents were processed (`Growth.expand` runs a wider expansion in passes of
  MAX_PASS_ROWS rows). Every node is computed once and attends to the committed prefix plus the cached K/V of
  its processed ancestors: an ancestor bit-matrix [K, K] over processed indices (K = capacity + 1) is filled
  row by row with index copies, never compaction, and its rows are the pass's tree mask over the draft cache's
  scratch slots [L0, L0 + K). Processed node j lives at slot L0 + j; the last column is a trash slot.
- Batches are padded to a few fixed sizes (`padded`: powers of two and 1.5x powers of two), so the draft's
  forward sees few distinct shapes (CUDA graphs capture each once, builders/draft_graphs.py). Padding rows
  repeat the first row's token, write the trash slot and attend to the root only; their logits are dropped.
- A generation's constraint (a grammar, DraftState.constraint) masks every row a pass returns, so builders
  never see a token it forbids and grow the budget in allowed nodes only; each processed node's path below the
  root names its row to the constraint (specexec/constraint.py). One extra host read per pass, only then.
- A toy draft (tests) implements the same calls on a Markov table (`draft_passes` picks the implementation).
- `Growth` is the tree under construction in fixed-capacity buffers (tokens/parents/depths/scores/proc);
  nodes are appended in fixed-size blocks or put at known indices, unused or dropped ones keep score -inf.
- `pick_children` chooses each expanded node's children without a host sync: top-k at temperature 0, else
  Gumbel-top-k of the processed draft distribution (a sample without replacement in draw order, Kool et al.,
  ICML'19), so rrs_wor verification is exact; tokens a row cannot propose come back with log-prob -inf.
- `host_values` is the one host synchronisation a builder makes per pass (its stop decision and whatever
  counts it needs, read together); everything else stays on the device.
- `QStore` keeps the processed draft log-probabilities of every processed node of the last tree, for
  builders verified with rrs_wor (`draft_probs(tree, node)`); `DrawsWithoutReplacement` is what those
  builders (chain, rsd, static, rsd-c) share besides growing: draft_probs, observe, kv_slots.

Does not know: the target model, verification, which nodes a builder expands or keeps, how the draft's forward
is computed (DraftState.forward).
"""
from __future__ import annotations

import bisect
import functools
from typing import Protocol

import torch
from torch import Tensor

from specexec.config import SamplingParams
from specexec.sampling import gumbel_topk, process_logits
from specexec.tree import TokenTree
from specexec.builders.base import DraftState
from specexec.uploads import upload


MAX_PASS_ROWS = 256    # the widest draft pass: a wider expansion runs in passes of this many rows (the memory
                       # plan budgets a draft pass's activations for it: planning/needs.py DRAFT_ROWS)


def padded(b: int) -> int:
    """The batch size a pass over b rows runs at: the smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... >= b."""
    if b <= 2:
        return max(b, 1)
    p = 1 << (b - 1).bit_length()
    return 3 * p // 4 if 3 * p // 4 >= b else p


def host_values(*values: Tensor) -> list[float]:
    """Read scalar tensors into Python in ONE device-to-host transfer (a builder's one sync per pass)."""
    return torch.stack([v.reshape(()).double() for v in values]).tolist()


class Passes(Protocol):
    """One tree's draft passes (see the module docstring). Processed index 0 is the root."""

    n_proc: int
    capacity: int
    L0: int

    def root(self, root_token: int) -> Tensor:
        """Processed draft log-probs [1, V] after the root."""

    def expand(self, tokens: Tensor, depths: Tensor, parent_proc: Tensor, proc: Tensor | None = None) -> Tensor:
        """tokens, depths, parent_proc long [b] -> processed log-probs [b, V]; the nodes get processed
        indices `proc` [b] (a builder recycling the slots of dropped nodes), by default n_proc .. n_proc + b - 1
        (in this order). n_proc counts the nodes processed so far either way."""

    def slots(self, proc: Tensor) -> Tensor | None:
        """Draft-cache slot per processed index (proc long [N+1], -1 kept as -1), or None (no cache)."""


class DraftPasses:
    """Passes over a DraftState's model and KV cache; at most `capacity` processed nodes (root included)."""

    def __init__(self, draft: DraftState, capacity: int, sampling: SamplingParams) -> None:
        self.draft, self.capacity, self.sampling = draft, capacity, sampling
        self.device = draft.cache.k.device
        self.width = capacity + 1                                   # K tree-mask columns; the last is trash
        self.anc = torch.zeros(self.width, self.width, dtype=torch.bool, device=self.device)
        self.n_proc, self.L0 = 0, draft.cache.length
        self.paths: dict[int, tuple[int, ...]] = {0: ()}     # processed index -> path below the root (constrained)

    def _processed(self, logits: Tensor, proc: list[int] | None = None) -> Tensor:
        """The draft's processed log-probs of `logits` [b, V], masked by the constraint at processed indices
        `proc` (None: the root)."""
        constraint = self.draft.constraint
        if constraint is None:
            return process_logits(logits, self.sampling)
        paths = [self.paths[j] for j in proc] if proc is not None else [()]
        allowed = constraint.allowed(paths, logits.shape[-1], logits.device, draft_logits=logits)
        logq = process_logits(logits, self.sampling, allowed=allowed)
        return logq.masked_fill(~allowed.any(dim=-1, keepdim=True), float("-inf"))    # nothing allowed: no child

    def root(self, root_token: int) -> Tensor:
        """Feed the pending tokens (ending with the root) in one causal pass; commit all but the root."""
        draft, dev = self.draft, self.device
        pending = draft.pending if draft.pending and draft.pending[-1] == root_token else [root_token]
        L, P = draft.cache.length, len(pending)
        slots = torch.arange(L, L + P, device=dev)
        causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
        logits = self._pass(upload(pending, dev), slots, causal, slots, None, None)
        draft.cache.keep(slots[:-1])
        draft.keep_root(root_token)
        self.L0, self.n_proc = draft.cache.length, 1
        self.anc[0, 0] = True
        self.paths = {0: ()}
        return self._processed(logits)

    def expand(self, tokens: Tensor, depths: Tensor, parent_proc: Tensor, proc: Tensor | None = None) -> Tensor:
        b, n, m = tokens.numel(), self.n_proc, padded(tokens.numel())
        if proc is None:
            if n + b > self.capacity:
                raise RuntimeError(f"draft pass over {b} nodes exceeds the tree's {self.capacity} draft slots")
            proc = torch.arange(n, n + b, device=self.device)
        new = torch.cat([proc, proc.new_full((m - b,), self.width - 1)])      # padding rows -> the trash slot
        if m > b:
            tokens = torch.cat([tokens, tokens[:1].expand(m - b)])
            depths = torch.cat([depths, depths.new_zeros(m - b)])
            parent_proc = torch.cat([parent_proc, parent_proc.new_zeros(m - b)])
        self.anc[new] = self.anc[parent_proc]
        self.anc[new, new] = True
        logits = self._pass(tokens, self.L0 + depths, self.anc[new], self.L0 + new, parent_proc, new)
        self.n_proc = n + b
        if self.draft.constraint is None:
            return process_logits(logits[:b], self.sampling)
        host = torch.cat([tokens[:b], parent_proc[:b], proc]).tolist()          # the constraint's one read
        paths = [self.paths[p] + (t,) for t, p in zip(host[:b], host[b:2 * b])]
        self.paths.update(zip(host[2 * b:], paths))
        return self._processed(logits[:b], host[2 * b:])

    def _pass(self, tokens: Tensor, positions: Tensor, mask: Tensor, slots: Tensor, parents: Tensor | None,
              proc: Tensor | None) -> Tensor:
        """One draft forward -> logits: the root pass (parents None: the last row's logits only) or an expansion
        (parents, proc: the rows' parents' and their own processed indices)."""
        return self.draft.forward(tokens, positions, mask, slots, last_only=parents is None)

    def slots(self, proc: Tensor) -> Tensor:
        return torch.where(proc >= 0, proc + self.L0, proc)


class FedPasses(DraftPasses):
    """DraftPasses of a drafter (specexec/network/drafter.py): the root pass reads the target's states queued
    with the pending tokens; an expansion reads each parent's own output state, kept per processed index
    (`out` [K, D], the trash row last), so every level is the drafter applied once more to its own output."""

    def __init__(self, draft: DraftState, capacity: int, sampling: SamplingParams) -> None:
        super().__init__(draft, capacity, sampling)
        model = draft.model
        self.out = torch.zeros(self.width, model.dim, dtype=model.embed_tokens.weight.dtype, device=self.device)

    def _pass(self, tokens: Tensor, positions: Tensor, mask: Tensor, slots: Tensor, parents: Tensor | None,
              proc: Tensor | None) -> Tensor:
        draft = self.draft
        if parents is None:
            if draft.states is None or draft.states.shape[0] != tokens.numel():
                raise RuntimeError(f"a drafter's root pass over {tokens.numel()} pending tokens needs as many "
                                   f"target states, it has {None if draft.states is None else draft.states.shape[0]}")
            logits, out = draft.fed_forward(tokens, positions, mask, slots, draft.states, last_only=True)
            self.out[0] = out[-1]
            return logits
        logits, out = draft.fed_forward(tokens, positions, mask, slots, self.out[parents])
        self.out[proc] = out.to(self.out.dtype)
        return logits


def draft_passes(draft: object, capacity: int, sampling: SamplingParams) -> Passes:
    """DraftPasses for a DraftState; a toy draft (tests) supplies its own through `.passes(...)`."""
    if draft is None:
        raise ValueError("this builder needs a draft model")
    if isinstance(draft, DraftState):
        return (FedPasses if draft.reads_target else DraftPasses)(draft, capacity, sampling)
    return draft.passes(capacity, sampling)                        # type: ignore[attr-defined]


class Growth:
    """The tree under construction in buffers of fixed `capacity` (index order is topological): long
    tokens/parents/depths/proc, float scores (cumulative draft log-prob or another non-increasing value; -inf
    marks a slot that is no node); proc = processed index (-1: never expanded). Nodes [0, n) exist."""

    def __init__(self, root_token: int, capacity: int, device: torch.device) -> None:
        long = dict(dtype=torch.long, device=device)
        self.capacity, self.n, self.device = capacity, 1, device
        self.tokens = torch.zeros(capacity, **long)
        self.parents = torch.full((capacity,), -1, **long)
        self.depths = torch.zeros(capacity, **long)
        self.scores = torch.full((capacity,), float("-inf"), device=device)
        self.proc = torch.full((capacity,), -1, **long)
        self.tokens[0], self.scores[0], self.proc[0] = root_token, 0.0, 0

    def add(self, tokens: Tensor, parents: Tensor, scores: Tensor) -> Tensor:
        """Append a block of k nodes (tokens, parents long [k], scores float [k]); returns their indices [k]."""
        first, k = self.n, tokens.numel()
        if first + k > self.capacity:
            raise RuntimeError(f"tree buffers full: {first} + {k} nodes > capacity {self.capacity}")
        idx = torch.arange(first, first + k, device=self.device)
        self.put(idx, tokens, parents, scores)
        self.n = first + k
        return idx

    def put(self, idx: Tensor, tokens: Tensor, parents: Tensor, scores: Tensor) -> None:
        """Write nodes at known indices idx [k] (parents already written; duplicates only for a dump slot)."""
        self.tokens[idx] = tokens
        self.parents[idx] = parents
        self.depths[idx] = self.depths[parents] + 1
        self.scores[idx] = scores.float()

    def expand(self, passes: Passes, nodes: Tensor, proc: Tensor | None = None) -> Tensor:
        """One draft pass over `nodes` [b] (their parents processed), or one per MAX_PASS_ROWS of them:
        processed log-probs [b, V]. proc [b]: the processed indices to give them (default: the next free ones
        in order)."""
        if proc is None:
            proc = torch.arange(passes.n_proc, passes.n_proc + nodes.numel(), device=nodes.device)
        parts = []
        for a in range(0, max(nodes.numel(), 1), MAX_PASS_ROWS):
            part, at = nodes[a:a + MAX_PASS_ROWS], proc[a:a + MAX_PASS_ROWS]
            parts.append(passes.expand(self.tokens[part], self.depths[part], self.proc[self.parents[part]], at))
        self.proc[nodes] = proc
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def tree(self, passes: Passes | None, keep: Tensor | None = None) -> TokenTree:
        """The TokenTree of nodes [0, n), or of `keep` (ascending, ancestor-closed, with the root)."""
        n = self.n
        slots = passes.slots(self.proc[:n]) if passes is not None else None
        full = TokenTree(self.tokens[:n], self.parents[:n], self.depths[:n], self.scores[:n], slots)
        return full if keep is None else full.select(keep, check=False)


def pick_children(logq: Tensor, k: int, sample: bool, rng: torch.Generator | None,
                  counts: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Up to k children of each of b expanded nodes, no host sync: logq [b, V] processed log-probs; counts long
    [b] (optional, each <= k): children per row. sample=False: the top-k; True: Gumbel-top-k, a sample without
    replacement listed in draw order.

    Returns (row, rank, token long [b*k], logp float [b*k]) grouped by row in proposal order (rank = position
    among the row's children). Tokens a row cannot propose (zero probability, rank >= its count) come back as
    token 0 with logp -inf."""
    b, dev = logq.shape[0], logq.device
    k = max(0, min(int(k), logq.shape[-1]))
    if sample:
        tok, keys = gumbel_topk(logq, k, rng)                       # tail of a short support: -1 / -inf
        ok = torch.isfinite(keys)
        top_lp = logq.gather(1, tok.clamp(min=0))
    else:
        top_lp, tok = logq.topk(k, dim=-1)
        ok = torch.isfinite(top_lp)
    if counts is not None:
        ok &= torch.arange(k, device=dev)[None] < counts.to(dev)[:, None]
    flat = torch.arange(b * k, device=dev)
    return flat // k, flat % k, tok.clamp(min=0).flatten(), top_lp.masked_fill(~ok, float("-inf")).flatten()


def kth_best(scores: Tensor, k: int) -> Tensor:
    """The k-th best of the non-root scores [n] (scores[0] is the root's), -inf while fewer exist."""
    if scores.numel() - 1 < k:
        return torch.full((), float("-inf"), dtype=scores.dtype, device=scores.device)
    return scores[1:].topk(k).values[-1]


class QStore:
    """Processed draft log-probs of the last tree's processed nodes (one [b, V] tensor per pass, not copied),
    so `probs(tree, node)` can hand rrs_wor the q the children were drawn from."""

    def __init__(self) -> None:
        self.parts: list[Tensor] = []
        self.starts: list[int] = []
        self.L0, self.keep = 0, True

    def reset(self, first: Tensor, passes: Passes, keep: bool = True) -> None:
        """Start a tree with the root pass's log-probs; keep=False (temperature 0: no rule asks for q) holds
        nothing, so the passes' [b, V] tensors are freed as usual. Processed index j is draft slot L0 + j."""
        self.keep, self.L0 = keep, passes.L0
        self.parts, self.starts = ([first], [0]) if keep else ([], [])

    def add(self, logq: Tensor) -> None:
        if self.keep:
            self.starts.append(self.starts[-1] + self.parts[-1].shape[0])
            self.parts.append(logq)

    def probs(self, tree: TokenTree, node: int) -> Tensor:
        """q [V] at `node` of the last tree built (the node must have been processed)."""
        if not self.parts:
            raise ValueError("no draft distributions were kept for this tree (built at temperature 0)")
        if tree.draft_slots is None or int(tree.draft_slots[node]) < 0:
            raise ValueError(f"node {node} was never processed by the draft: no draft distribution there")
        proc = int(tree.draft_slots[node]) - self.L0
        part = bisect.bisect_right(self.starts, proc) - 1
        return self.parts[part][proc - self.starts[part]].exp()


class DrawsWithoutReplacement:
    """What the builders whose children are draws from q without replacement (chain, rsd, static, rsd-c)
    share besides growing: the q of every node the last tree processed, handed to rrs_wor (`draft_probs`);
    nothing learnt from the target (`observe`: their shapes and draws look at the draft alone); a draft cache
    of one slot per processed node plus the trash slot (`kv_slots`). A mixin whose QStore (`_q`) is made on
    first use, so each builder's dataclass fields, hence its constructor, stay its own."""

    @functools.cached_property
    def _q(self) -> QStore:
        return QStore()

    def draft_probs(self, tree: TokenTree, node: int) -> Tensor:
        """Processed draft probabilities [V] at `node` of the last tree built."""
        return self._q.probs(tree, node)

    def observe(self, tree: TokenTree, accepted_nodes: list[int], bonus: int) -> None:
        """Nothing to learn: the tree's shape and draws depend on the draft only."""

    def kv_slots(self, budget: int) -> int:
        return budget + 2                                     # processed nodes + the trash slot
