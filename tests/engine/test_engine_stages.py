"""The engine's shape (issue 17): a step is five named stages in order; the builder's and the models' optional
abilities are Protocols checked once, when the engine is built (never looked up per step); the step ledger is
one (GenerationStats reads the profiler's records). Counted on the tiny pair, greedy, fp32.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from specexec.abilities import has
from specexec.builders.base import FollowsCosts, KeepsDraftProbs, LearnsFromTarget
from specexec.companions.protocol import Companions, Step
from specexec.companions.roster import CostsToBuilder, TunerHears
from specexec.config import EngineConfig, SamplingParams
from specexec.decoding.engine import Engine
from specexec.companions.gate import Pilot
from specexec.network.model import Closes, MakesCache, PlansPrefill
from specexec.options import ConfigError
from specexec.runtime.assembly import make_builder
from tests.tiny_models import load_pair_models, prompt

OPTIONAL = ("draft_probs", "observe_topk", "bind", "observe_target", "observe_costs")
ABILITIES = {"chain": {KeepsDraftProbs}, "static": {KeepsDraftProbs}, "rsd": {KeepsDraftProbs},
             "recycling": {LearnsFromTarget}, "specexec": {FollowsCosts}, "dynamic": set(), "optree": set()}
STAGES = ["_draft", "_verify", "_commit", "_observe", "_account"]


@pytest.fixture(scope="module")
def models(tiny_pair: tuple[Path, Path], tiny_perturbed_draft: Path):
    return load_pair_models(tiny_pair, tiny_perturbed_draft)


class Without:
    """A builder seen through __getattr__ with some optional members hidden; counts every lookup of an
    optional member, found or not (what per-step discovery would do)."""

    def __init__(self, inner, hidden: tuple[str, ...] = ()) -> None:
        self.inner, self.hidden, self.lookups = inner, hidden, Counter()

    def __getattr__(self, name: str):
        if name in OPTIONAL:
            self.lookups[name] += 1
            if name in self.hidden:
                raise AttributeError(name)
        return getattr(self.inner, name)


@pytest.mark.parametrize("name", sorted(ABILITIES))
def test_each_builder_offers_exactly_its_abilities(name: str) -> None:
    builder = make_builder(name)
    assert {a for a in (KeepsDraftProbs, LearnsFromTarget, FollowsCosts) if has(builder, a)} == ABILITIES[name]
    assert has(Without(builder), FollowsCosts) == (FollowsCosts in ABILITIES[name])      # through __getattr__
    assert not has(Without(builder, OPTIONAL), KeepsDraftProbs) and not has(None, KeepsDraftProbs)


def test_model_abilities(models) -> None:
    target = models["target"]
    assert has(target, MakesCache) and not has(target, PlansPrefill) and not has(target, Closes)
    assert not has(torch.nn.Linear(2, 2), MakesCache)


@pytest.mark.parametrize("name,hidden", [("dynamic", ()), ("specexec", ("observe_costs",))])
def test_missing_abilities_are_recognised_once_at_construction(models, name: str, hidden: tuple) -> None:
    """Lookups of optional members happen while the engine is built, none while it generates; a builder
    without observe_costs is simply not told the costs."""
    builder = Without(make_builder(name), hidden)
    engine = Engine(models["target"], models["perturbed"], EngineConfig(budget=8), builder)
    assert not engine.keeps_draft_probs and not engine.observe_topk and not engine.follows_costs
    at_construction = sum(builder.lookups.values())
    assert at_construction > 0
    out = [t for s in engine.generate(prompt(3), 24) for t in s]
    assert len(out) == 24 and len(engine.stats.steps) > 1
    assert sum(builder.lookups.values()) == at_construction, builder.lookups


def test_a_builder_that_keeps_no_draft_probs_is_refused_before_any_work(models) -> None:
    """rrs_wor needs draft_probs: a without-replacement builder lacking it is refused by rule_for (before
    the prefill), from what the engine learnt when it was built."""
    builder = Without(make_builder("chain"), ("draft_probs",))
    engine = Engine(models["target"], models["perturbed"], EngineConfig(budget=4, verifier="rrs_wor"), builder)
    sampling = SamplingParams(temperature=1.0, seed=0)
    with pytest.raises(ConfigError, match="does not keep"):
        engine.rule_for(sampling)
    with pytest.raises(ConfigError, match="does not keep"):
        next(engine.generate(prompt(1), 4, sampling))
    assert engine._caches is None                                   # nothing was prefilled


def test_a_step_is_five_stages_in_order(models, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(models["target"], models["perturbed"], EngineConfig(budget=8), make_builder("specexec"))
    calls: list[str] = []
    for stage in STAGES:
        real = getattr(engine, stage)
        monkeypatch.setattr(engine, stage, lambda *a, _real=real, _name=stage, **k: (calls.append(_name),
                                                                                     _real(*a, **k))[1])
    n_steps = sum(1 for _ in engine.generate(prompt(5), 16))
    steps = len(engine.stats.steps)
    assert steps >= n_steps > 1 and calls == STAGES * steps


def test_one_ledger(models) -> None:
    """stats.steps are the profiler's step records (the same list), so their summaries agree by construction."""
    engine = Engine(models["target"], models["perturbed"], EngineConfig(budget=8), make_builder("specexec"))
    out = [t for s in engine.generate(prompt(7), 20) for t in s]
    stats, prof = engine.stats, engine.profiler
    assert stats.steps is prof.steps and len(stats.steps) == prof.summary()["steps"] > 1
    assert sum(s.accepted for s in stats.steps) >= len(out) == stats.generated
    mine, theirs = stats.summary(8, "specexec"), prof.summary()
    assert mine["draft_ms"] == pytest.approx(theirs["draft_ms"], abs=0.01)
    assert mine["tree_size"] == theirs["tree_size"] and mine["budget_trace"] == theirs["budget_trace"] == "8×" + \
        str(len(stats.steps))
    first = stats
    list(engine.generate(prompt(8), 4))                             # a new call: a new ledger, new stats
    assert engine.stats is not first and engine.stats.steps is prof.steps and len(prof.steps) <= 4


class Recorder:
    """A companion with every hook: records them per step; makes every third step plain (the root alone)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.timed_sizes: list[int] = []
        self.steps = 0

    def before_step(self, step: Step) -> None:
        self.steps += 1
        self.calls.append("before_step")
        if self.steps % 3 == 0:
            step.limit(0)

    def trim(self, tree):
        self.calls.append("trim")
        return tree

    def before_verify(self, step: Step) -> None:
        self.calls.append("before_verify")

    def after_verify(self, step: Step) -> None:
        assert step.accepted is not None and step.tree is not None
        self.calls.append("after_verify")

    def timed(self, step: Step) -> None:
        self.timed_sizes.append(step.tree.size)


def test_the_companions_and_their_order(models) -> None:
    """One ordered list, built once: the pilot before the tuner (which then hears drafted trees only), the
    experts after them, a cost-following builder last; nothing a run does not have."""
    target, draft = models["target"], models["perturbed"]
    gated = Engine(target, draft, EngineConfig(budget=16, auto_budget=True), make_builder("specexec"))
    kinds = [type(c) for c in gated.companions.members]
    assert kinds == [Pilot, TunerHears, CostsToBuilder] and not gated.companions.members[1].plain_steps
    ungated = Engine(target, draft, EngineConfig(budget=16, auto_budget=True, gate="off"), make_builder("dynamic"))
    assert [type(c) for c in ungated.companions.members] == [TunerHears]
    assert ungated.companions.members[0].plain_steps
    assert Engine(target, None, EngineConfig(), None).companions.members == []


def test_a_companion_takes_part_in_every_step(models) -> None:
    """A new companion is one more member, not a branch: its hooks run in stage order each step (trim on the
    drafted trees of a call that trims), a plain step it asks for is the root alone, its timed hook hears every
    step in order, and the output stays the target's."""
    target, draft = models["target"], models["perturbed"]
    want = [t for s in Engine(target, None, EngineConfig(), None).generate(prompt(9), 20) for t in s]
    engine = Engine(target, draft, EngineConfig(budget=8), make_builder("specexec"))
    recorder = Recorder()
    engine.companions = Companions(engine.companions.members + [recorder])
    assert [t for s in engine.generate(prompt(9), 20) for t in s] == want
    steps = engine.stats.steps
    per_step = [["before_step", "before_verify", "after_verify"] if i % 3 == 2 else
                ["before_step", "trim", "before_verify", "after_verify"] for i in range(len(steps))]
    assert len(steps) > 3 and recorder.calls == [c for calls in per_step for c in calls]
    assert recorder.timed_sizes == [s.tree_size for s in steps]
    assert all(s.tree_size == 0 for s in steps[2::3]) and all(s.tree_size > 0 for s in steps[::3])
