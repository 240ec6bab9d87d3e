"""The SpecExec builder's width follows the cost ratio r = target pass seconds / draft pass seconds: today's
economy (budget / 8 nodes per pass) where a draft pass is dear (a CPU), the paper's width (up to 128 beams)
where it is cheap (a GPU streaming the target, r ~ 100). Counted on the tiny pairs, deterministic (greedy).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specexec.builders.specexec import SpecExecBuilder, width_fraction
from specexec.config import EngineConfig
from specexec.decoding.engine import Engine
from tests.sync_count import count_calls
from tests.tiny_models import load_pair_models, prompt

PROMPTS = [prompt(200 + i, 16) for i in range(4)]


@pytest.fixture(scope="module")
def models(tiny_pair: tuple[Path, Path], tiny_perturbed_draft: Path):
    return load_pair_models(tiny_pair, tiny_perturbed_draft)


def paper_width() -> SpecExecBuilder:
    """The SpecExec paper's configuration: every candidate up to 128 per pass, top-32 children, 32 passes."""
    return SpecExecBuilder(max_beams=128, max_branch=32, max_passes=32, beam_fraction=1, cost_ratio=0.0)


class Rows:
    """Counts the draft's forwards (passes) and the rows they process (its compute) with a pre-hook."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.rows = self.passes = 0
        self.handle = model.register_forward_pre_hook(self.hook)

    def hook(self, _module, args) -> None:
        self.rows += int(args[0].shape[-1])
        self.passes += 1


def tokens_per_pass(models, builder, budget: int, draft: str = "perturbed") -> tuple[float, Rows]:
    """(tokens per target pass, the draft's passes and rows) over PROMPTS, 40 new tokens each."""
    target = models["target"]
    rows = Rows(models[draft])
    tokens = steps = 0
    for ids in PROMPTS:
        engine = Engine(target, models[draft], EngineConfig(budget=budget), builder)
        tokens += sum(len(s) for s in engine.generate(ids, 40))
        steps += len(engine.stats.steps)
    rows.handle.remove()
    return tokens / steps, rows


def test_width_policy() -> None:
    assert width_fraction(None, 32, 64, 8) == 8 and width_fraction(5.0, 32, 64, 8) == 8
    assert width_fraction(64.0, 32, 64, 8) == 1 and width_fraction(400.0, 32, 64, 8) == 1
    mid = [width_fraction(r, 32, 64, 8) for r in (33.0, 40.0, 50.0, 63.0)]
    assert mid == sorted(mid, reverse=True) and 1 < mid[-1] < mid[0] < 8
    b = SpecExecBuilder()
    assert b.beams(256) == 32 and b.beams(16) == 2                       # ratio unknown: economy
    b.observe_costs(draft_s=1.0, target_s=5.0, draft_passes=10)           # r = 50: a draft pass is 1/50
    assert b.ratio() == pytest.approx(50.0) and 32 < b.beams(256) < 256
    assert SpecExecBuilder(cost_ratio=100.0).beams(256) == 128 and SpecExecBuilder(cost_ratio=100.0).beams(16) == 16
    assert SpecExecBuilder(cost_ratio=3.0).beams(256) == 32


@pytest.mark.slow
@pytest.mark.parametrize("budget", [16, 64])
def test_at_a_high_cost_ratio_the_tree_accepts_at_least_the_paper_width_tree(models, budget: int) -> None:
    """A target pass costs >= 50 draft passes: equal budget, at least the paper-width tree's tokens per pass,
    in fewer (wider) draft passes than the economy width; at a low ratio the economy tree spends fewer rows."""
    paper, _ = tokens_per_pass(models, paper_width(), budget)
    high, wide = tokens_per_pass(models, SpecExecBuilder(cost_ratio=50.0), budget)
    low, narrow = tokens_per_pass(models, SpecExecBuilder(cost_ratio=3.0), budget)
    assert high >= paper, f"budget {budget}: {high:.3f} tokens per pass at r = 50 < paper width {paper:.3f}"
    assert wide.passes < narrow.passes and narrow.rows < wide.rows, (budget, vars(wide), vars(narrow))
    assert low > 1.5


def test_the_engine_reports_costs_and_draft_passes_to_the_builder(models) -> None:
    """observe_costs gets each step's seconds and exactly the draft passes the step ran (counted)."""
    calls = []

    class Spy(SpecExecBuilder):
        def observe_costs(self, draft_s: float, target_s: float, draft_passes: int) -> None:
            calls.append((draft_s, target_s, draft_passes))
            super().observe_costs(draft_s, target_s, draft_passes)

    builder = Spy()
    engine = Engine(models["target"], models["perturbed"], EngineConfig(budget=32), builder)
    with count_calls(models["perturbed"]) as forwards:
        steps = sum(1 for _ in engine.generate(PROMPTS[0], 30))
    prefill = 1                                                     # the draft's prefill is one forward
    assert len(calls) == len(engine.stats.steps) >= steps
    assert sum(p for *_, p in calls) == forwards[0] - prefill
    assert all(d > 0 and t > 0 and p >= 1 for d, t, p in calls)
    assert builder.ratio() is not None and builder.ratio() > 0


class Widest(Rows):
    """Rows: also the widest pass."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.widest = 0
        super().__init__(model)

    def hook(self, module, args) -> None:
        super().hook(module, args)
        self.widest = max(self.widest, int(args[0].shape[-1]))


def test_no_draft_pass_is_wider_than_the_plan_budgets(models) -> None:
    """OPT-Tree expands a whole layer of the tree at once (up to `budget` nodes): at budget 600 its expansions
    run in passes of at most MAX_PASS_ROWS rows, the widest draft pass the memory plan counts activations for
    (issue 55's audit: one pass of 768 rows, 600 padded, before); its trees still hold more nodes than that and
    the ids are the target's."""
    from specexec.builders.growth import MAX_PASS_ROWS
    from specexec.builders.optree import OptTreeBuilder
    from specexec.planning.needs import DRAFT_ROWS
    assert MAX_PASS_ROWS == DRAFT_ROWS
    target, draft = models["target"], models["perturbed"]
    alone = [t for s in Engine(target, None, EngineConfig(budget=1), None).generate(PROMPTS[0], 6) for t in s]
    rows = Widest(draft)
    engine = Engine(target, draft, EngineConfig(budget=600), OptTreeBuilder())
    got = [t for s in engine.generate(PROMPTS[0], 6) for t in s]
    rows.handle.remove()
    assert got == alone
    assert max(s.tree_size for s in engine.stats.steps) > MAX_PASS_ROWS and rows.widest <= MAX_PASS_ROWS
