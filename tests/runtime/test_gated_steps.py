"""The gate in the decoding loop (specexec/companions/gate.py): whatever it switches to, the output is the target's --
greedy ids equal the target alone's, sampled tokens follow the target's distribution -- with a scripted gate
that flips between plain and speculative steps; a gated run reports its steps in stats.gate; a fixed budget
gates nothing unless --gate on."""
from __future__ import annotations

from itertools import cycle
from pathlib import Path

import pytest

from specexec.builders.specexec import SpecExecBuilder
from specexec.checkpoints.loading import load_model
from specexec.config import EngineConfig, SamplingParams
from specexec.decoding.engine import Engine
from specexec.tuning.budget import BudgetTuner, CostModel, CurveFit
from specexec.companions.gate import Switch
from tests.sampling.chi2 import chi2_pvalue
from tests.sampling.sampling_pairs import PROMPT, exact_pairs, sample_pairs
from tests.tiny_models import load_pair_models, prompt

PATTERN = [False, False, True, True, True, False, True, False, False, False, True]   # True = a plain step


class Flipper:
    """A gate that follows PATTERN (cycled) and reports a switch whenever the kind changes."""

    def __init__(self, pattern: list[bool] = PATTERN) -> None:
        self.kinds, self.last = cycle(pattern), None
        self.heard: list[bool] = []

    def next_plain(self) -> bool:
        return next(self.kinds)

    def observe(self, speculative: bool, tokens: int, seconds: float) -> Switch | None:
        self.heard.append(speculative)
        changed = self.last is not None and self.last != speculative
        self.last = speculative
        return Switch(speculative, 10.0, 9.0, 4) if changed else None

    def charge(self, seconds: float) -> None:
        self.charged = getattr(self, "charged", 0.0) + seconds


@pytest.fixture(scope="module")
def models(tiny_pair: tuple[Path, Path], tiny_perturbed_draft: Path):
    return load_pair_models(tiny_pair, tiny_perturbed_draft)


def run(engine: Engine, ids: list[int], n: int, sampling: SamplingParams = SamplingParams()) -> list[int]:
    return [t for step in engine.generate(ids, n, sampling) for t in step]


@pytest.mark.parametrize("config", [EngineConfig(budget=8, gate="on"), EngineConfig(budget=64, auto_budget=True)])
def test_greedy_ids_equal_the_target_alone_however_the_gate_switches(models, config: EngineConfig) -> None:
    alone = Engine(models["target"], None, EngineConfig(), None)
    for seed in (0, 1):
        ids = prompt(seed)
        want = run(alone, ids, 48)
        engine = Engine(models["target"], models["perturbed"], config, SpecExecBuilder())
        flipper = engine.pilot.gate = Flipper()
        assert run(engine, ids, 48) == want, f"seed {seed}"
        gate = engine.stats.summary(8, "specexec")["gate"]
        assert gate["plain_steps"] > 2 and gate["speculative_steps"] > 2 and gate["switches"] >= 3
        assert len(gate["events"]) == gate["switches"] and gate["events"][0].startswith("drafting ")
        assert flipper.heard.count(False) == gate["plain_steps"]
        assert sum(s.tree_size == 0 for s in engine.stats.steps) >= gate["plain_steps"]


def test_a_fixed_budget_gates_nothing_unless_asked(models) -> None:
    assert Engine(models["target"], models["perturbed"], EngineConfig(budget=8), SpecExecBuilder()).pilot is None
    assert Engine(models["target"], models["perturbed"], EngineConfig(budget=8, gate="off", auto_budget=True),
                  SpecExecBuilder()).pilot is None
    assert Engine(models["target"], None, EngineConfig(budget=8, gate="on"), None).pilot is None
    engine = Engine(models["target"], models["perturbed"], EngineConfig(budget=8), SpecExecBuilder())
    run(engine, prompt(0), 16)
    assert "gate" not in engine.stats.summary(8, "specexec")


def test_the_gate_does_not_judge_drafting_on_the_tuners_descent(models) -> None:
    """--budget auto: the speculative steps whose budget the tuner chose while descending from its first one
    (costs steep in the tree size: it goes down at once) are not heard by the gate; every later one is."""
    steep = CurveFit()
    for n in (1, 2, 4, 8, 16, 32, 64, 65):
        steep.add(n, 0.01 * n)
    tuner = BudgetTuner(64, CostModel(steep, CurveFit(dict(steep.points), origin=True)))
    engine = Engine(models["target"], models["perturbed"], EngineConfig(budget=64, auto_budget=True),
                    SpecExecBuilder(), tuner=tuner)
    flipper = engine.pilot.gate = Flipper([False])                 # every step speculative
    settling, choose = [], tuner.next_budget
    tuner.next_budget = lambda: (choose(), settling.append(not tuner.settled))[0]
    run(engine, prompt(0), 32)
    assert settling[0] and not settling[-1] and sorted(settling, reverse=True) == settling
    assert all(flipper.heard) and len(flipper.heard) == settling.count(False)


class Off(Flipper):
    """A gate that is off (not drafting) and probes with two speculative steps after `plain` plain ones."""

    def __init__(self, plain: int) -> None:
        super().__init__([True] * plain + [False, False])
        self.drafting = False


def test_a_gated_off_run_leaves_the_new_prompt_to_the_probes_catch_up(models) -> None:
    """While the gate is off a new prompt is not prefilled into the draft (the target alone's time to first
    token); the first probe's catch-up prefills it with the steps since, and the ids stay the target's."""
    alone = Engine(models["target"], None, EngineConfig(), None)
    engine = Engine(models["target"], models["perturbed"], EngineConfig(budget=8, gate="on"), SpecExecBuilder())
    engine.pilot.gate = Off(plain=30)
    ids = prompt(3)
    catch_ups = []
    engine.prefill, prefill = (lambda m, c, t, w="target": (catch_ups.append((w, len(t))), prefill(m, c, t, w))[1],
                               engine.prefill)
    engine.pilot.prefill = engine.prefill
    assert run(engine, ids, 12) == run(alone, ids, 12)
    assert [w for w, _ in catch_ups] == ["target"]                 # no draft prefill, no probe yet
    catch_ups.clear()
    engine.pilot.gate = Off(plain=30)
    assert run(engine, ids, 40) == run(alone, ids, 40)
    drafts = [n for w, n in catch_ups if w == "draft"]
    assert drafts[0] == len(ids) - 1 + 30                         # the prompt and the plain steps' tokens at once


@pytest.fixture(scope="module")
def small(tiny_small_pair: tuple[Path, Path]):
    target, perturbed = tiny_small_pair
    return load_model(target), load_model(perturbed)


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [[True, False], [False, True, True]])
def test_sampled_tokens_follow_the_target_across_switches(small, pattern: list[bool]) -> None:
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    engine = Engine(small[0], small[1], EngineConfig(budget=6, gate="on"), SpecExecBuilder())
    engine.pilot.gate = Flipper(pattern)
    counts = sample_pairs(engine, sampling, 600)
    assert chi2_pvalue(counts, exact_pairs(small[0], sampling, PROMPT)) > 1e-3


def test_generate_json_reports_stats_gate_only_when_gated(capsys, tiny_pair, tiny_perturbed_draft) -> None:
    import json

    from cli.main import main

    argv = ["generate", "--model", str(tiny_pair[0]), "--draft", str(tiny_perturbed_draft), "--prompt", "The fox",
            "--max-new-tokens", "12", "--budget", "4", "--json"]
    assert main(argv + ["--gate", "on"]) == 0
    gate = json.loads(capsys.readouterr().out)["stats"]["gate"]
    assert gate["plain_steps"] + gate["speculative_steps"] >= 1 and gate["switches"] == len(gate["events"])
    assert main(argv) == 0                                  # a fixed budget with --gate auto: not gated
    assert "gate" not in json.loads(capsys.readouterr().out)["stats"]


def test_chat_prints_each_switch_in_one_line() -> None:
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from cli.chat import Answer, ChatSession

    out = io.StringIO()
    line = Switch(False, 8.1, 6.9, 16).line(19)
    session = SimpleNamespace(console=Console(file=out, width=300), profile=False)
    ChatSession._report(session, Answer([5], "x", False, {"generated": 1, "gate": {"events": [line]}}))
    assert out.getvalue().splitlines()[0] == \
        "drafting off at step 19: target alone 8.1 tok/s > speculative 6.9 tok/s (last 16 steps)"
