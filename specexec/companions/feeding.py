"""The engine's companion for a drafter (specexec/network/drafter.py): what it asks of the target's passes and
how their states reach it.

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

from dataclasses import replace

import torch

from specexec.builders.base import DraftState, Prefill
from specexec.kv.cache import KVCache
from specexec.network.drafter import Drafter
from specexec.network.model import Transformer
from specexec.decoding.prompt_passes import RowListener
from specexec.decoding.uploads import upload


def tell_taps(target: Transformer, taps: tuple[int, ...]) -> None:
    """Tell the target which layers' inputs its passes keep (a drafter's taps; () for none)."""
    if target.execution.taps != taps:
        target.run_as(replace(target.execution, taps=taps))


class TargetFeed:
    """One drafter fed by one target (see the module docstring)."""

    def __init__(self, target: Transformer, drafter: Drafter) -> None:
        self.target, self.drafter = target, drafter

    @staticmethod
    def reusable(kept: int, drafter_rows: int, prompt_len: int) -> int:
        """Tokens both caches keep of a prompt whose first `kept` the target holds."""
        return max(min(kept, drafter_rows, prompt_len - 2), 0)

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

    def committed(self, draft: DraftState, tree, nodes: list[int], bonus: int, hidden: torch.Tensor,
                  path_tokens: list[int] | None = None, path_slots: list[int] | None = None) -> None:
        """After verification: the drafter keeps its root's row and queues the accepted tokens with the
        target's states at the accepted nodes; the target lets its tapped inputs go. path_tokens / path_slots:
        as DraftState.commit takes them (read on the host already)."""
        draft.commit(tree, nodes, bonus, self.states(hidden, nodes), path_tokens, path_slots)
        self.target.drop_tapped()
