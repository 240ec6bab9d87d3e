"""--budget auto in the engine: exact output, per-step budgets from the tuner; calibration measured by the engine,
kept on disk by the runtime."""
from __future__ import annotations

from pathlib import Path

import pytest

from specexec.builders.specexec import SpecExecBuilder
from specexec.config import EngineConfig
from specexec.decoding.engine import Engine
from specexec.options import budget_options
from specexec.checkpoints.loading import load_model
from specexec.runtime.assembly import Runtime
from specexec.tuning.budget import calibration_sizes
from specexec.tuning.calibration import cost_fingerprint, default_cost_path


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path))
    return tmp_path


def test_auto_budget_is_exact_and_the_engine_writes_no_file(tiny_pair, tiny_perturbed_draft,
                                                            cache_dir: Path) -> None:
    """The engine measures (its tuner gains target costs, on_calibrated hears them once) and reads or writes
    nothing on disk: calibration files are the runtime's."""
    target, draft = load_model(tiny_pair[0]), load_model(tiny_perturbed_draft)
    ids = [1, 30, 31, 32, 33, 34]
    want = [t for s in Engine(target, None, EngineConfig(budget=1), None).generate(ids, 40) for t in s]
    engine = Engine(target, draft, EngineConfig(**budget_options("auto", 64)), SpecExecBuilder())
    heard = []
    engine.on_calibrated = lambda curve: heard.append(set(curve.points))
    got = [t for s in engine.generate(ids, 40) for t in s]
    assert got == want
    assert heard == [{n + 1 for n in calibration_sizes(64)}]        # the calibration passes' tree sizes
    assert not any(cache_dir.rglob("*")), list(cache_dir.rglob("*"))     # no cost file from the engine
    trees = [s for s in engine.stats.steps if s.budget is not None]     # the gate's plain steps have no tree
    assert all(1 <= s.tree_size <= 64 for s in trees)
    gate = engine.stats.summary("auto", "specexec")["gate"]             # --budget auto gates (--gate auto)
    assert len(engine.stats.steps) - len(trees) == gate["plain_steps"]
    list(engine.generate(ids, 8))
    assert len(heard) == 1                                          # measured once per engine


def test_the_runtime_keeps_calibration_on_disk(tiny_pair, tiny_perturbed_draft, cache_dir: Path) -> None:
    """Runtime: the first engine measures and the runtime saves; the next engine is given the saved costs
    (before any generate) and measures nothing."""
    rt = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), EngineConfig(**budget_options("auto", 64)))
    path = default_cost_path(cost_fingerprint(rt.engine.target))
    assert not path.exists() and not rt.engine.tuner.costs.target.points
    prompt = rt.encode("The quick brown fox")
    want = [t for s in rt.generate_ids(prompt, 24) for t in s]
    assert path.is_file()
    mtime = path.stat().st_mtime_ns
    again = rt.variant(rt.config)
    assert set(again.engine.tuner.costs.target.points) == {n + 1 for n in calibration_sizes(64)}   # given
    heard = []
    again.engine.on_calibrated = heard.append
    assert [t for s in again.generate_ids(prompt, 24) for t in s] == want
    assert heard == [] and path.stat().st_mtime_ns == mtime          # loaded, not re-measured


def test_new_cpu_kernels_make_new_cost_files(tiny_pair, monkeypatch) -> None:
    """A CPU target's pass costs depend on which compiled kernels run: another kernel library (new sources, another
    compiler or CPU) or none gives another fingerprint, so costs measured with the old kernels are not reused."""
    from specexec.checkpoints.loading import load_model
    from specexec.tuning import calibration

    target = load_model(tiny_pair[0])
    now = cost_fingerprint(target)
    assert cost_fingerprint(target) == now
    monkeypatch.setattr(calibration, "cpu_kernels_status", lambda: "CPU kernels: avx2 (/x/cpu-kernels-0123.so)")
    assert cost_fingerprint(target) != now


def test_profiler_shows_the_budget_each_step_asked_for(tiny_pair, tiny_perturbed_draft, cache_dir: Path) -> None:
    import io

    from rich.console import Console

    from specexec.profiler import summary_table

    target, draft = load_model(tiny_pair[0]), load_model(tiny_perturbed_draft)
    engine = Engine(target, draft, EngineConfig(**budget_options("auto", 64)), SpecExecBuilder())
    list(engine.generate([1, 30, 31, 32, 33, 34], 40))
    trees = [s for s in engine.profiler.steps if s.budget is not None]   # the gate's plain steps have no tree
    assert len(engine.profiler.steps) - len(trees) == engine.profiler.counters.get("gate_plain_steps", 0)
    asked = [s.budget for s in trees]
    assert all(1 <= b <= 64 for b in asked)
    assert all(s.tree_size <= s.budget for s in trees)
    summary = engine.profiler.summary()
    trace = summary["budget_trace"]
    cut = trace.startswith("… ")                   # more than 12 runs (likelier when timings are noisy): the tail
    shown = [int(b) for part in trace.removeprefix("… ").split()
             for b in [part.split("×")[0]] * (int(part.split("×")[1]) if "×" in part else 1)]
    assert shown == asked[-len(shown):] and (len(shown) < len(asked) if cut else len(shown) == len(asked))
    out = io.StringIO()
    Console(file=out, width=400).print(summary_table(summary))
    assert f"budget per step {trace}" in out.getvalue()
    fixed = Engine(target, draft, EngineConfig(budget=8), SpecExecBuilder())
    list(fixed.generate([1, 30, 31, 32, 33, 34], 12))
    assert {s.budget for s in fixed.profiler.steps} == {8}


def test_generate_reports_the_budget_trace(capsys, tiny_pair, tiny_perturbed_draft, cache_dir: Path) -> None:
    import json

    from cli.main import main

    argv = ["generate", "--model", str(tiny_pair[0]), "--draft", str(tiny_perturbed_draft), "--prompt", "The fox",
            "--max-new-tokens", "16", "--budget", "auto", "--max-budget", "32"]
    assert main(argv) == 0
    assert "budget per step " in capsys.readouterr().err
    assert main(argv + ["--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["budget"] == "auto" and stats["budget_trace"]
