"""The engine's companions and their one order (`engine_companions`); every hook runs them in it
(specexec/companions/protocol.py):

1. LongRoPE's switch (`LongRoPESteps`, only when a model has one): re-runs a cache whose root passed the
   switch under the short factors, then caps the budget so no node needs the long factors;
2. the pilot (specexec/companions/gate.py `Pilot`, --gate): makes the step plain when the gate says so (after
   LongRoPE's re-run, which a plain step needs as much); hears each step's times before the tuner does, and
   adds a plain step's target pass to the tuner's costs itself;
3. the budget tuner (`TunerHears`, --budget auto): hears a step's times, only a drafted tree's while there is a
   pilot (a plain step would look like free drafting; without a pilot it hears every step);
4. an MoE target's experts (specexec/companions/experts.py `ExpertSteps`): trims trees, reads the target's
   expert counters before the pass, learns and counts after it (setting `step.expert_s`, which 2 and 3 hear),
   and hears the drafting seconds;
5. a builder that follows costs (`CostsToBuilder`): the draft and target seconds of a step that drafted.

The engine is handed its roster (`Roster`: the hooks' companions in that order, the draft's feed, and the
parts a stage asks of itself: the tuner's budget, the pilot's verdict for a prefill); the engine imports none
of the companions, and each is wired to the others here (the tuner's cost model gains the MoE term).

Does not know: how the stages run, how the pilot or the experts decide, where the times come from.
"""
from __future__ import annotations

from specexec.abilities import has
from specexec.builders.base import FollowsCosts, Prefill, TreeBuilder
from specexec.companions.experts import ExpertPasses, ExpertSteps
from specexec.companions.feeding import DraftFeed, feed_for
from specexec.companions.gate import Pilot
from specexec.companions.protocol import Companions, Step
from specexec.config import EngineConfig
from specexec.network import longrope
from specexec.network.model import Transformer
from specexec.profiler import Profiler
from specexec.tuning.budget import BudgetTuner


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


class Roster:
    """An engine's companions, built when the engine is assembled: the budget tuner (--budget auto with a builder;
    `tuner` a given one, e.g. holding saved costs), the pilot (--gate), an MoE target's experts (`experts`: a given
    ExpertPasses, else one that learns and counts with every expert held; None for a dense target), the draft's
    feed, and `companions`: the hooks' members in their order. Setting `experts` (a benchmark's synthetic
    costs) makes the target record its routing and rebuilds the members around it."""

    def __init__(self, target: Transformer, draft: Transformer | None, config: EngineConfig,
                 builder: TreeBuilder | None, profiler: Profiler, prefill: Prefill,
                 tuner: BudgetTuner | None = None, experts: ExpertPasses | None = None) -> None:
        auto = config.auto_budget and builder is not None
        self.tuner = (tuner if tuner is not None else BudgetTuner(config.budget)) if auto else None
        self.pilot = Pilot.for_engine(config, builder, self.tuner, profiler, prefill)
        self.feed: DraftFeed = feed_for(target, draft, builder, lambda: self.pilot is None or self.pilot.drafting)
        self.cost_builder = builder if has(builder, FollowsCosts) else None    # its width follows the cost ratio
        self._parts = (target, draft, prefill, profiler)
        device = next(target.parameters()).device
        self.experts = experts or (ExpertPasses(target.args, device=device) if target.args.moe else None)
        if self.experts is not None and self.tuner is not None:     # the one cost model gains the MoE term
            self.tuner.costs.experts = self.experts.expected_seconds

    @property
    def experts(self) -> ExpertPasses | None:
        return self._experts

    @experts.setter
    def experts(self, experts: ExpertPasses | None) -> None:
        target, draft, prefill, profiler = self._parts
        self._experts = experts
        if experts is not None:
            experts.attach(target)
        self.companions = engine_companions(target, draft, prefill, profiler, self.pilot, self.tuner, experts,
                                            self.cost_builder)
