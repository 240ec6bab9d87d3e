"""The engine's companions: what takes part in every decoding step besides its five stages, through one
protocol of hooks. A companion offers any of them; each hook is an ability (specexec/abilities.py) asked once,
when the engine is built (`Companions`):

- `before_step(step)`: before the draft stage; may prefill a cache again, make the step a plain one
  (`step.limit(0)`: the root alone, the target alone) or cap its budget (`step.limit(n)`);
- `trim(tree) -> tree`: the drafted tree, before it is verified (inside the draft span; only on the calls whose
  rule verifies any sub-tree exactly, and never on a root-only tree);
- `before_verify(step)` / `after_verify(step)`: around the target's pass (after: `step.accepted` is known,
  inside the target span; a companion may set `step.expert_s`);
- `timed(step)`: once the step's draft and target seconds are known (CUDA: once its events completed; in step
  order, never waited for inside a step: specexec/profiler.py).

The engine's companions, in their one order (`engine_companions`), every hook running them in it:

1. LongRoPE's switch (`LongRoPESteps`, only when a model has one): re-runs a cache whose root passed the
   switch under the short factors, then caps the budget so no node needs the long factors;
2. the pilot (specexec/gate.py `Pilot`, --gate): makes the step plain when the gate says so (after LongRoPE's
   re-run, which a plain step needs as much); hears each step's times before the tuner does, and adds a plain
   step's target pass to the tuner's costs itself;
3. the budget tuner (`TunerHears`, --budget auto): hears a step's times, only a drafted tree's while there is a
   pilot (a plain step would look like free drafting; without a pilot it hears every step);
4. an MoE target's experts (`ExpertSteps` over specexec/expert_passes.py): trims trees, reads the target's
   expert counters before the pass, learns and counts after it (setting `step.expert_s`, which 2 and 3 hear),
   and hears the drafting seconds;
5. a builder that follows costs (`CostsToBuilder`): the draft and target seconds of a step that drafted.

Does not know: how the stages run, trees' contents, acceptance rules, where the times come from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from specexec.abilities import has
from specexec.builders.base import DraftState, Prefill, TreeBuilder
from specexec.expert_passes import CountsExperts, ExpertPasses
from specexec.kv.cache import KVCache
from specexec.network import longrope
from specexec.network.model import Transformer
from specexec.profiler import Profiler
from specexec.tree import TokenTree
from specexec.tuning.budget import BudgetTuner
from specexec.verify import Accepted


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


class LongRoPESteps:
    """LongRoPE's switch before each step (specexec/network/longrope.py): a cache whose root passed the switch
    under the short factors is run again with the long ones; while short, the budget is capped."""

    def __init__(self, target: Transformer, prefill: Prefill) -> None:
        self.target, self.prefill = target, prefill

    def before_step(self, step: Step) -> None:
        runs = [(self.target, step.cache, "target")]
        if step.draft is not None:
            runs.append((step.draft.model, step.draft.cache, "draft"))
        longrope.rerun_past_switch(runs, step.context, self.prefill)
        step.limit(longrope.budget_cap(self.target, step.cache))


class TunerHears:
    """The budget tuner hears each step's times (plain steps only when no pilot adds them to its costs)."""

    def __init__(self, tuner: BudgetTuner, plain_steps: bool) -> None:
        self.tuner, self.plain_steps = tuner, plain_steps

    def timed(self, step: Step) -> None:
        tree = step.tree
        if tree.size or self.plain_steps:
            self.tuner.observe(tree.size, tree.scores, step.accepted.nodes, step.draft_s, step.target_s,
                               step.expert_s)


class ExpertSteps:
    """An MoE target's ExpertPasses in the loop: trims the drafted tree, reads a streaming target's expert
    counters before the pass (CountsExperts), learns and counts after it, hears the drafting seconds."""

    def __init__(self, experts: ExpertPasses, target: Transformer, profiler: Profiler) -> None:
        self.experts, self.target, self.profiler = experts, target, profiler
        self.counts = has(target, CountsExperts)          # its expert traffic, read each step
        self._before: dict[str, float] | None = None

    def trim(self, tree: TokenTree) -> TokenTree:
        return self.experts.trim(tree, self.target)

    def before_verify(self, step: Step) -> None:
        self._before = self.target.expert_counters() if self.counts else None

    def after_verify(self, step: Step) -> None:
        self.experts.observe(step.tree, step.accepted.nodes, self.target, self.profiler, self._before)
        step.expert_s = self.experts.last_expert_s

    def timed(self, step: Step) -> None:
        self.experts.observe_times(step.draft_s)


class CostsToBuilder:
    """A builder whose width follows the cost ratio (FollowsCosts) hears the seconds of each step that drafted."""

    def __init__(self, builder: TreeBuilder) -> None:
        self.builder = builder

    def timed(self, step: Step) -> None:
        if step.passes:
            self.builder.observe_costs(step.draft_s, step.target_s, step.passes)


def engine_companions(target: Transformer, draft: Transformer | None, prefill: Prefill, profiler: Profiler,
               pilot: object | None, tuner: BudgetTuner | None, experts: ExpertPasses | None,
               cost_builder: TreeBuilder | None) -> Companions:
    """The engine's companions in their order (module docstring); None where a run has no such part.
    cost_builder: the builder when it FollowsCosts."""
    switches = any(longrope.switch_of(m) is not None for m in (target, draft) if m is not None)
    return Companions([
        LongRoPESteps(target, prefill) if switches else None,
        pilot,
        TunerHears(tuner, plain_steps=pilot is None) if tuner is not None else None,
        ExpertSteps(experts, target, profiler) if experts is not None else None,
        CostsToBuilder(cost_builder) if cost_builder is not None else None,
    ])
