"""The TreeBuilder interface and the draft-side state every model-based builder shares.

A builder turns (draft model + its KV cache, the tokens the draft has not seen yet, a node budget, sampling
params) into a TokenTree. `DraftState` holds the draft model, its cache and the "pending" tokens: accepted
tokens the draft never processed (leaves it did not expand, and the bonus token), the last of which is the
next root. The builder feeds them with its first draft pass, so the draft never runs a pass just to catch up.

Does not know: the target model, verification, or how the engine commits the target's cache.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from specexec.config import SamplingParams
from specexec.kv.cache import KVCache
from specexec.network.model import Transformer, TreeMask
from specexec.tree import TokenTree
from specexec.builders import draft_graphs


@dataclass
class DraftState:
    """The draft model, its cache (committed prefix) and pending tokens (not yet in the cache; last = root).
    `passes` counts draft forwards (the engine divides draft time by it). `cuda_graphs`: replay the forward
    from CUDA graphs on CUDA (None: on unless SPECEXEC_CUDA_GRAPHS=0; see builders/draft_graphs.py)."""

    model: Transformer
    cache: KVCache
    pending: list[int] = field(default_factory=list)
    passes: int = 0
    cuda_graphs: bool | None = None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                slots: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """One draft pass. tokens, positions, slots long [b]; tree_mask bool [b, K] over the scratch slots
        [L0, L0 + K) of the cache (L0 = cache.length); every query also sees the whole committed prefix
        [0, L0). K/V are written at `slots`. -> fp32 logits [b, V], or [1, V] of the last token with last_only
        (the LM head, a large share of a small draft's pass, then runs on one row). Every draft forward goes
        through here."""
        self.passes += 1
        graphs = draft_graphs.runner(self.model, self.cache, self.cuda_graphs)
        if graphs is not None:
            logits = graphs.run(tokens, positions, tree_mask, slots)
            return logits[-1:] if last_only else logits
        hidden = self.model(tokens[None], positions[None], TreeMask(self.cache.length, tree_mask), self.cache, slots)
        return self.model.logits(hidden[:, -1:] if last_only else hidden)

    def commit(self, tree: TokenTree, accepted_nodes: list[int], bonus: int) -> None:
        """After verification: keep the draft KV of accepted nodes the draft processed (an ancestor-closed
        prefix of the path) and queue the rest of the path plus the bonus token as pending."""
        slots = tree.draft_slots
        if slots is None:                                    # builder ran no draft passes (e.g. recycling)
            self.pending = self.pending[:-1] + [int(t) for t in tree.tokens[accepted_nodes].tolist()] + [bonus]
            return
        path_slots = slots[accepted_nodes].tolist()
        n_done = next((i for i, s in enumerate(path_slots) if s < 0), len(path_slots))
        self.cache.keep(torch.tensor(path_slots[:n_done], dtype=torch.long, device=self.cache.k.device))
        self.pending = [int(t) for t in tree.tokens[accepted_nodes[n_done:]].tolist()] + [bonus]


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
