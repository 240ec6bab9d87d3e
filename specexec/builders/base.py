"""The TreeBuilder interface and the draft-side state every model-based builder shares.

A builder turns (draft model + its KV cache, the tokens the draft has not seen yet, a node budget, sampling
params) into a TokenTree. `DraftState` holds the draft model, its cache and the "pending" tokens: accepted
tokens the draft never processed (leaves it did not expand, and the bonus token), the last of which is the
next root. The builder feeds them with its first draft pass, so the draft never runs a pass just to catch up.

Does not know: the target model, verification, or how the engine commits the target's cache.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from specexec.config import SamplingParams
from specexec.constraint import Constraint
from specexec.kv.cache import KVCache
from specexec.network.drafter import Drafter
from specexec.network.model import Transformer, TreeMask
from specexec.tree import TokenTree
from specexec.uploads import upload
from specexec.builders import draft_graphs


Prefill = Callable[..., None]      # Engine.prefill(model, cache, ids, which, states=None, on_rows=None)
RowListener = Callable[[int, torch.Tensor], None]        # (start, hidden [T, D]) of one prefill chunk


@dataclass
class DraftState:
    """The draft model, its cache (committed prefix) and pending tokens (not yet in the cache; last = root).
    `passes` counts draft forwards (the engine divides draft time by it). `cuda_graphs`: replay the forward
    from CUDA graphs on CUDA (None: on unless SPECEXEC_CUDA_GRAPHS=0; see builders/draft_graphs.py).

    A drafter (specexec/network/drafter.py) also holds `states` [P, D]: the state before each pending token (the
    target's, from its passes), and `fed`: whether the root's is a real one (not with a one-token prompt, whose
    first token has no state before it: its row is drafted from zeros and never committed). A drafter's tree
    rows read its own states, so after verification only the root's row is kept: the accepted tokens come back
    as pending with the target's states (commit). `constraint`: the generation's grammar, which masks every
    row the draft expands (builders/growth.py)."""

    model: Transformer
    cache: KVCache
    pending: list[int] = field(default_factory=list)
    passes: int = 0
    cuda_graphs: bool | None = None
    states: torch.Tensor | None = None
    fed: bool = True
    constraint: Constraint | None = None      # the generation's grammar: growth masks with it
    slot_positions: torch.Tensor | None = field(default=None, repr=False)   # per cache slot: its position

    @property
    def reads_target(self) -> bool:
        """Whether the draft is a drafter: it drafts from the target's states."""
        return isinstance(self.model, Drafter)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                slots: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """One draft pass. tokens, positions, slots long [b]; tree_mask bool [b, K] over the scratch slots
        [L0, L0 + K) of the cache (L0 = cache.length); every query also sees the whole committed prefix
        [0, L0). K/V are written at `slots`. -> fp32 logits [b, V], or [1, V] of the last token with last_only
        (the LM head, a large share of a small draft's pass, then runs on one row). Every draft forward goes
        through here (a drafter's through fed_forward)."""
        self.passes += 1
        graphs = draft_graphs.runner(self.model, self.cache, self.cuda_graphs)
        if graphs is not None:
            logits = graphs.run(tokens, positions, tree_mask, slots)
            return logits[-1:] if last_only else logits
        hidden = self.model(tokens[None], positions[None], self.tree_mask(tree_mask, positions, slots), self.cache,
                            slots)
        return self.model.logits(hidden[:, -1:] if last_only else hidden)

    def tree_mask(self, tree_mask: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> TreeMask:
        """The TreeMask of a pass whose rows [b] see tree_mask [b, K] over the scratch [L0, L0 + K). A draft
        with a sliding window narrower than K (a tree grown deeper than the window) also needs the positions of
        the K columns, written by earlier passes, so that a node does not see ancestors past its window
        (attention windows the tree part by the keys' positions): each slot's position as last written, kept
        here (one index write a pass, no sync); unwritten columns are masked by tree_mask anyway."""
        L0, K = self.cache.length, tree_mask.shape[1]
        windows = [k.window for k in getattr(getattr(self.model, "args", None), "layer_kinds", ()) if k.window]
        if not windows:
            return TreeMask(L0, tree_mask)
        held = self.slot_positions
        if held is None or held.numel() < self.cache.capacity or held.device != positions.device:
            self.slot_positions = torch.zeros(self.cache.capacity, dtype=torch.long, device=positions.device)
            if held is not None and held.device == positions.device:
                self.slot_positions[:held.numel()] = held[:self.cache.capacity]
        self.slot_positions[slots] = positions
        if K <= min(windows):
            return TreeMask(L0, tree_mask)
        return TreeMask(L0, tree_mask, self.slot_positions[L0:L0 + K])

    def fed_forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                    slots: torch.Tensor, states: torch.Tensor, last_only: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A drafter's pass: forward's arguments plus each row's state before its token, states [b, D] ->
        (fp32 logits [b, V] (or [1, V] of the last row), the states it hands on [b, D])."""
        self.passes += 1
        out = self.model(tokens[None], positions[None], self.tree_mask(tree_mask, positions, slots), self.cache, slots,
                         states[None])[0]
        return self.model.logits(out[-1:] if last_only else out), out

    def keep_root(self, root: int) -> None:
        """After the pass that committed the pending tokens but the root: the root alone is pending."""
        self.pending = [root]
        if self.states is not None:
            self.states = self.states[-1:]

    def extend(self, tokens: list[int], states: torch.Tensor | None) -> None:
        """Queue tokens (with a drafter: each with the target's state before it, states [n, D])."""
        self.pending = self.pending + list(tokens)
        if states is not None:
            self.states = states if self.states is None else torch.cat([self.states, states])

    def catch_up(self, prefill: Prefill) -> None:
        """Feed every pending token but the root to the draft's cache (prefill: the engine's chunked passes)."""
        if len(self.pending) < 2:
            return
        if self.reads_target:
            prefill(self.model, self.cache, self.pending[:-1], "draft", self.states[:-1])
        else:
            prefill(self.model, self.cache, self.pending[:-1], "draft")
        self.keep_root(self.pending[-1])

    def commit(self, tree: TokenTree, accepted_nodes: list[int], bonus: int,
               states: torch.Tensor | None = None, path_tokens: list[int] | None = None,
               path_slots: list[int] | None = None) -> None:
        """After verification: keep the draft KV of accepted nodes the draft processed (an ancestor-closed
        prefix of the path) and queue the rest of the path plus the bonus token as pending. A drafter keeps
        its root's row at most, and `states` [m+1, D] are the target's states at the accepted nodes (each the
        state before the next token of the path, the last the bonus's). path_tokens / path_slots: the accepted
        nodes' tokens and tree.draft_slots when the caller has them on the host already (verify.Accepted:
        then nothing here waits for the device), else read here."""
        slots = tree.draft_slots
        if path_tokens is None:
            path_tokens = [int(t) for t in tree.tokens[upload(accepted_nodes, tree.device)].tolist()]
        if slots is not None and path_slots is None:
            path_slots = slots[upload(accepted_nodes, slots.device)].tolist()
        if self.reads_target:
            return self._commit_fed(path_slots, accepted_nodes, path_tokens, bonus, states)
        if slots is None:                                    # builder ran no draft passes (e.g. recycling)
            self.pending = self.pending[:-1] + path_tokens + [bonus]
            return
        n_done = next((i for i, s in enumerate(path_slots) if s < 0), len(path_slots))
        self.cache.keep(upload(path_slots[:n_done], self.cache.k.device))
        self.pending = path_tokens[n_done:] + [bonus]

    def _commit_fed(self, path_slots: list[int] | None, accepted_nodes: list[int], path_tokens: list[int],
                    bonus: int, states: torch.Tensor | None) -> None:
        if states is None or states.shape[0] != len(accepted_nodes):
            raise ValueError(f"a drafter's commit needs the target's states at the {len(accepted_nodes)} accepted "
                             f"nodes, got {None if states is None else tuple(states.shape)}")
        root_row = path_slots is not None and path_slots[0] >= 0
        if root_row and self.fed:                   # the root's row read the target's state: it stays
            self.cache.keep(upload(path_slots[:1], self.cache.k.device))
            self.pending, self.states = path_tokens[1:] + [bonus], states
        elif self.fed:                              # the root was never run (a plain step): it stays pending
            self.pending = self.pending[:-1] + path_tokens + [bonus]
            self.states = torch.cat([self.states, states])
        else:                                       # a first token has no state before it: dropped
            self.pending = self.pending[:-1] + path_tokens[1:] + [bonus]
            self.states = torch.cat([self.states[:-1], states])
        self.fed = True


class TreeBuilder(Protocol):
    """One way to grow a draft tree. `drafting` names how children are chosen ("deterministic" distinct
    tokens, or "without_replacement" samples in draw order): it decides which verification rules are exact.
    Optional abilities are the Protocols below (KeepsDraftProbs, LearnsFromTarget, FollowsCosts); the engine
    checks them once when it is built (specexec.abilities.has)."""

    name: str
    drafting: str
    needs_draft: bool

    def build(self, draft: DraftState | None, root_token: int, budget: int, sampling: SamplingParams,
              rng: torch.Generator | None) -> TokenTree: ...

    def observe(self, tree: TokenTree, accepted_nodes: list[int], bonus: int) -> None: ...

    def kv_slots(self, budget: int) -> int:
        """Draft-cache slots one tree of this budget may write beyond the committed prefix."""


@runtime_checkable
class KeepsDraftProbs(Protocol):
    """A builder that keeps the processed draft distribution a node's children were drawn from (required by
    the rrs_wor rule, i.e. by "without_replacement" builders at T > 0)."""

    def draft_probs(self, tree: TokenTree, node: int) -> torch.Tensor:
        """-> [V] the distribution node's children were drawn from."""


@runtime_checkable
class LearnsFromTarget(Protocol):
    """A builder that learns from the target's top-k at every verified node (Token Recycling);
    `observe_topk` > 0 opts in, `bind` sizes its tables once."""

    observe_topk: int

    def bind(self, vocab_size: int, device: torch.device | str) -> None: ...

    def observe_target(self, tree: TokenTree, topk: torch.Tensor) -> None:
        """topk long [N+1, observe_topk]: the target's top-k ids after each node of `tree`."""


@runtime_checkable
class FollowsCosts(Protocol):
    """A builder whose width follows the cost ratio of the two passes (SpecExec): it hears each step's
    drafting and target seconds and the draft passes the step ran."""

    def observe_costs(self, draft_s: float, target_s: float, draft_passes: int) -> None: ...
