"""The protocol of the engine's companions: what takes part in every decoding step besides its five stages
(specexec/decoding/engine.py), through hooks. A companion offers any of them; each hook is an ability
(specexec/abilities.py) asked once, when the engine is built (`Companions`):

- `before_step(step)`: before the draft stage; may prefill a cache again, make the step a plain one
  (`step.limit(0)`: the root alone, the target alone) or cap its budget (`step.limit(n)`);
- `trim(tree) -> tree`: the drafted tree, before it is verified (inside the draft span; only on the calls whose
  rule verifies any sub-tree exactly, and never on a root-only tree);
- `before_verify(step)` / `after_verify(step)`: around the target's pass (after: `step.accepted` is known,
  inside the target span; a companion may set `step.expert_s`);
- `timed(step)`: once the step's draft and target seconds are known (CUDA: once its events completed; in step
  order, never waited for inside a step: specexec/profiler.py).

Every hook runs the companions in their one order (the engine's: specexec/companions/roster.py).

Does not know: which companions exist, how the stages run, trees' contents, acceptance rules, where the times
come from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from specexec.abilities import has
from specexec.builders.base import DraftState
from specexec.kv.cache import KVCache
from specexec.tree import TokenTree
from specexec.acceptance.rules import Accepted


@dataclass
class Step:
    """One decoding step as its companions see it, filled in as its stages run: the target's cache, the
    draft's state (None: nothing drafts with a draft model), the committed context; before the draft the most
    nodes it may grow (`cap`: 0 a plain step, None no cap); then the tree verified, the budget asked for (None:
    nothing drafted), the draft passes it took, whether the tuner was still descending from its first budget
    (`settling`); after verification the accepted path and the MoE cost model's seconds of the pass's experts;
    once timed its draft and target seconds."""

    cache: KVCache
    draft: DraftState | None
    context: list[int]
    cap: int | None = None
    tree: TokenTree | None = None
    budget: int | None = None
    passes: int = 0
    settling: bool = False
    accepted: Accepted | None = None
    expert_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0

    def limit(self, cap: int | None) -> None:
        """Draft at most `cap` nodes this step (None: no limit from this caller)."""
        if cap is not None:
            self.cap = cap if self.cap is None else min(self.cap, cap)


@runtime_checkable
class PlansSteps(Protocol):
    def before_step(self, step: Step) -> None: ...


@runtime_checkable
class TrimsTrees(Protocol):
    def trim(self, tree: TokenTree) -> TokenTree: ...


@runtime_checkable
class WatchesPasses(Protocol):
    def before_verify(self, step: Step) -> None: ...

    def after_verify(self, step: Step) -> None: ...


@runtime_checkable
class HearsTimes(Protocol):
    def timed(self, step: Step) -> None: ...


class Companions:
    """The companions in their one order; each hook runs over those that have it (asked here, once)."""

    def __init__(self, members: list[object | None]) -> None:
        self.members = [m for m in members if m is not None]
        self._plans = [m for m in self.members if has(m, PlansSteps)]
        self._trims = [m for m in self.members if has(m, TrimsTrees)]
        self._watch = [m for m in self.members if has(m, WatchesPasses)]
        self._hear = [m for m in self.members if has(m, HearsTimes)]

    @property
    def trims(self) -> bool:
        """Whether a companion trims trees."""
        return bool(self._trims)

    def before_step(self, step: Step) -> None:
        for m in self._plans:
            m.before_step(step)

    def trim(self, tree: TokenTree) -> TokenTree:
        for m in self._trims:
            tree = m.trim(tree)
        return tree

    def before_verify(self, step: Step) -> None:
        for m in self._watch:
            m.before_verify(step)

    def after_verify(self, step: Step) -> None:
        for m in self._watch:
            m.after_verify(step)

    def timed(self, step: Step) -> None:
        for m in self._hear:
            m.timed(step)
