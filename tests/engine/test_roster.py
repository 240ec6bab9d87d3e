"""The engine is handed its companions (specexec/companions/roster.Roster) and imports none of them: decoding/
engine.py names neither the pilot, the tuner, the experts, a feed nor the drafter. The draft's feed is a
companion with hooks (begin, reusable, prefill, committed) the engine calls whoever drafts: a roster whose feed
records its hooks hears them in order each generation, and the output stays the target's.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specexec.companions.feeding import ModelFeed, NoDraft, TargetFeed
from specexec.companions.roster import Roster
from specexec.config import EngineConfig
from specexec.decoding import engine as engine_module
from specexec.decoding.engine import Engine
from specexec.runtime.assembly import make_builder
from tests.tiny_models import load_pair_models, prompt

COMPANIONS = {"Pilot", "BudgetTuner", "ExpertPasses", "TargetFeed", "ModelFeed", "NoDraft", "Drafter",
              "engine_companions"}
MODULES = {"specexec.companions.gate", "specexec.companions.experts", "specexec.companions.feeding",
           "specexec.network.drafter"}


@pytest.fixture(scope="module")
def models(tiny_pair: tuple[Path, Path], tiny_perturbed_draft: Path):
    return load_pair_models(tiny_pair, tiny_perturbed_draft)


def test_the_engine_imports_none_of_its_companions() -> None:
    tree = ast.parse(Path(engine_module.__file__).read_text())
    names, modules = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            modules.add(node.module)
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            modules |= {a.name for a in node.names}
    assert not names & COMPANIONS and not modules & MODULES, (names & COMPANIONS, modules & MODULES)
    assert "isinstance(draft, Drafter)" not in Path(engine_module.__file__).read_text()


class Recording(Roster):
    """The default roster, its feed's hooks recorded in order."""

    calls: list[str] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        inner, calls = self.feed, self.calls

        class Feed:
            def __getattr__(self, name: str):
                hook = getattr(inner, name)

                def called(*a, **k):
                    calls.append(name)
                    return hook(*a, **k)
                return called
        self.feed = Feed()


def test_the_feed_is_a_companion_the_engine_calls_whoever_drafts(models) -> None:
    target, draft = models["target"], models["perturbed"]
    want = [t for s in Engine(target, None, EngineConfig(), None).generate(prompt(9), 20) for t in s]
    for d, builder in ((draft, make_builder("specexec")), (None, None)):
        Recording.calls = []
        engine = Engine(target, d, EngineConfig(budget=8), builder, roster=Recording)
        assert [t for s in engine.generate(prompt(9), 20) for t in s] == want
        steps = len(engine.stats.steps)
        assert Recording.calls == ["begin", "reusable", "prefill"] + ["committed"] * steps, Recording.calls


def test_each_run_gets_its_feed(models) -> None:
    target, draft = models["target"], models["perturbed"]
    assert type(Engine(target, None, EngineConfig(), None).feed) is NoDraft
    assert type(Engine(target, draft, EngineConfig(), None).feed) is NoDraft            # nothing drafts with it
    assert type(Engine(target, draft, EngineConfig(), make_builder("specexec")).feed) is ModelFeed
