"""The draft's feed: the engine's companion that says how the draft hears the prompt and each step's outcome,
through four hooks the engine calls whoever drafts (`DraftFeed`): `begin` (before a generation), `reusable` (how
much of a cached prompt both caches keep), `prefill` (the target's prompt passes and the draft's) and
`committed` (after verification). Three feeds (`feed_for` picks one): none drafts (`NoDraft`: the target alone),
a draft model (`ModelFeed`: its own prefill, gated off while the pilot says so, and its own commit), and a
drafter (`TargetFeed`, specexec/network/drafter.py: what it asks of the target's passes and how their states
reach it):

- Before a generation (`tell_taps`): the target is told which layers' inputs to keep (Execution.taps).
- Prompt reuse (`reusable`): a drafter's row of token i + 1 reads the target's state at token i, so its rows lag
  the target's by one; both caches keep no more than the drafter holds, and the target recomputes at least its
  last row (the state before the root).
- Prefill (`start`): the target's cache handed to a drafter that attends to its K/V (Gemma 4's assistant), the
  drafter's state for a prompt and the target prefill's row listener that feeds it chunk
  by chunk (each chunk's rows queue the tokens after them; the drafter catches up on all but the root). A
  one-token prompt has no state before its token: its root reads zeros and is never committed.
- After verification (`states`): the drafter's input states at the accepted rows of the pass (the target's
  output, or its tapped layers' inputs fused); then the target lets the tapped inputs go.

Does not know: trees, acceptance, the builders (they see a DraftState like any other), how the target computes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch

from specexec.builders.base import DraftState, Prefill, RowListener, TreeBuilder
from specexec.kv.cache import KVCache
from specexec.kv.prefix_cache import PrefixCache
from specexec.network import longrope
from specexec.network.drafter import Drafter
from specexec.network.model import Transformer
from specexec.uploads import upload
from specexec.tree import TokenTree
from specexec.acceptance.rules import Accepted


def tell_taps(target: Transformer, taps: tuple[int, ...]) -> None:
    """Tell the target which layers' inputs its passes keep (a drafter's taps; () for none)."""
    if target.execution.taps != taps:
        target.run_as(replace(target.execution, taps=taps))


class DraftFeed(Protocol):
    """The draft's feed (module docstring): the engine calls each hook whoever drafts."""

    reads_target_rows: bool          # the draft's cache is built from the target's prefill rows (a drafter)

    def begin(self) -> None:
        """Before a generation: the target is told which layers' inputs its passes keep."""

    def reusable(self, kept: int, target_cache: KVCache, draft_cache: KVCache | None, prompt_len: int) -> int:
        """Tokens both caches keep of a prompt whose first `kept` the target's cache holds (the draft's cache
        cut to them)."""

    def prefill(self, prompt_ids: list[int], shared: int, target_cache: KVCache, draft_cache: KVCache | None,
                prefill: Prefill) -> DraftState | None:
        """The target prefills prompt[L:-1] (L = its cache's length), the draft hears its part -> the draft's
        state (None: nothing drafts with a draft model)."""

    def committed(self, draft: DraftState | None, tree: TokenTree, acc: Accepted, hidden: torch.Tensor) -> None:
        """After verification: the draft keeps its accepted rows and queues what it has not seen."""


def _prefill_target(prompt_ids: list[int], target_cache: KVCache, prefill: Prefill, target: Transformer,
                    on_rows: RowListener | None = None) -> None:
    ids = prompt_ids[target_cache.length:-1]
    prefill(target, target_cache, ids) if on_rows is None else prefill(target, target_cache, ids, on_rows=on_rows)
    target_cache.snapshot()                  # a recurrent state can return here (a later turn's prefix, /retry)


def _path(acc: Accepted) -> tuple[list[int] | None, list[int] | None]:
    """The accepted path's tokens and draft slots as DraftState.commit takes them (read on the host already)."""
    return ([acc.root] + acc.tokens[:-1], acc.draft_slots) if acc.root >= 0 else (None, None)


class NoDraft:
    """Nothing drafts with a draft model (no draft, or a builder that needs none): the target alone."""

    reads_target_rows = False        # the draft hears nothing of the target's prefill (a prefix cache may skip it)

    def __init__(self, target: Transformer) -> None:
        self.target = target

    def begin(self) -> None:
        tell_taps(self.target, ())

    def reusable(self, kept: int, target_cache: KVCache, draft_cache: KVCache | None, prompt_len: int) -> int:
        return kept

    def prefill(self, prompt_ids: list[int], shared: int, target_cache: KVCache, draft_cache: KVCache | None,
                prefill: Prefill) -> DraftState | None:
        _prefill_target(prompt_ids, target_cache, prefill, self.target)
        return None

    def committed(self, draft: DraftState | None, tree: TokenTree, acc: Accepted, hidden: torch.Tensor) -> None:
        pass


class ModelFeed(NoDraft):
    """A draft model: it prefills its own part of the prompt (unless the pilot has gated drafting off: it
    catches up when a probe starts, `drafting`) and commits its own rows."""

    def __init__(self, target: Transformer, draft: Transformer, drafting: Callable[[], bool]) -> None:
        super().__init__(target)
        self.draft, self.drafting = draft, drafting
        self.prefix_cache: PrefixCache | None = None     # the draft's own prompt blocks (kv/prefix_cache.py)

    def prefill(self, prompt_ids: list[int], shared: int, target_cache: KVCache, draft_cache: KVCache | None,
                prefill: Prefill) -> DraftState | None:
        _prefill_target(prompt_ids, target_cache, prefill, self.target)
        draft_cache.truncate(draft_cache.reusable(shared))
        longrope.begin(self.draft, draft_cache, len(prompt_ids))
        if self.drafting():
            cached = self.prefix_cache is not None and not draft_cache.long_rope
            if cached:
                self.prefix_cache.restore(prompt_ids[:-1], draft_cache, draft_cache.length)
            prefill(self.draft, draft_cache, prompt_ids[draft_cache.length:-1], "draft")
            draft_cache.snapshot()
            if cached:
                self.prefix_cache.store(prompt_ids[:-1], draft_cache)
        return DraftState(self.draft, draft_cache, list(prompt_ids[draft_cache.length:]))

    def committed(self, draft: DraftState | None, tree: TokenTree, acc: Accepted, hidden: torch.Tensor) -> None:
        draft.commit(tree, acc.nodes, acc.tokens[-1], None, *_path(acc))


def feed_for(target: Transformer, draft: Transformer | None, builder: TreeBuilder | None,
             drafting: Callable[[], bool]) -> DraftFeed:
    """The feed of a run: a drafter's (TargetFeed), a draft model's (ModelFeed), or none drafts (NoDraft)."""
    if draft is None or builder is None or not builder.needs_draft:
        return NoDraft(target)
    return TargetFeed(target, draft) if isinstance(draft, Drafter) else ModelFeed(target, draft, drafting)


class TargetFeed:
    """One drafter fed by one target (see the module docstring)."""

    reads_target_rows = True         # its cache is built from the target's prefill rows

    def __init__(self, target: Transformer, drafter: Drafter) -> None:
        self.target, self.drafter = target, drafter

    def begin(self) -> None:
        tell_taps(self.target, self.drafter.taps)

    def reusable(self, kept: int, target_cache: KVCache, draft_cache: KVCache | None, prompt_len: int) -> int:
        """A drafter's rows lag the target's by one: no more than it holds, the state before the root recomputed."""
        keep = target_cache.reusable(max(min(kept, draft_cache.length, prompt_len - 2), 0))
        draft_cache.truncate(keep)
        return keep

    def prefill(self, prompt_ids: list[int], shared: int, target_cache: KVCache, draft_cache: KVCache | None,
                prefill: Prefill) -> DraftState | None:
        """The drafter is fed from the target's prefill rows as they come."""
        draft, on_rows = self.start(prompt_ids, target_cache.length, draft_cache, prefill, target_cache)
        _prefill_target(prompt_ids, target_cache, prefill, self.target, on_rows)
        self.finish_start(draft, prompt_ids)
        return draft

    def start(self, prompt_ids: list[int], keep: int, cache: KVCache, prefill: Prefill, target_cache: KVCache
              ) -> tuple[DraftState, RowListener]:
        """The drafter's state for `prompt_ids` (its cache holds the rows of tokens 1..keep) and the listener of
        the target's prefill rows prompt[keep:-1]; a drafter that attends to the target's K/V is handed its cache."""
        self.drafter.attend_to(target_cache)
        draft = DraftState(self.drafter, cache)

        def on_rows(start: int, hidden: torch.Tensor) -> None:
            first = keep + start + 1
            draft.extend(prompt_ids[first:first + hidden.shape[0]], self.states(hidden))
            draft.catch_up(prefill)
        return draft, on_rows

    def finish_start(self, draft: DraftState, prompt_ids: list[int]) -> None:
        """After the prefill: a one-token prompt's root has no state before it (zeros, never committed)."""
        if not draft.pending:
            w = self.drafter.embed_tokens.weight
            draft.pending, draft.fed = [prompt_ids[-1]], False
            draft.states = torch.zeros(1, self.drafter.dim, dtype=w.dtype, device=w.device)

    def states(self, hidden: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """The drafter's input states [R, D] at `rows` (default all) of the last target pass: hidden [N, D_t] is
        its output; the layers the drafter taps were kept by the pass (Transformer.tapped)."""
        tapped = self.target.tapped if self.drafter.taps else None
        if rows is not None:
            index = upload(rows, hidden.device)
            hidden = hidden.index_select(0, index)
            tapped = [t[0].index_select(0, index) for t in tapped] if tapped is not None else None
        elif tapped is not None:
            tapped = [t[0] for t in tapped]
        return self.drafter.read_target(hidden, tapped)

    def committed(self, draft: DraftState | None, tree: TokenTree, acc: Accepted, hidden: torch.Tensor) -> None:
        """After verification: the drafter keeps its root's row and queues the accepted tokens with the
        target's states at the accepted nodes; the target lets its tapped inputs go."""
        draft.commit(tree, acc.nodes, acc.tokens[-1], self.states(hidden, acc.nodes), *_path(acc))
        self.target.drop_tapped()
