"""--budget auto in the engine: exact output, per-step budgets from the tuner, calibration cached on disk."""
from __future__ import annotations

from pathlib import Path

import pytest

from specexec.builders.specexec import SpecExecBuilder
from specexec.config import EngineConfig, budget_options
from specexec.engine import Engine
from specexec.loading import load_model
from specexec.tuning import cost_fingerprint, default_cost_path


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path))
    return tmp_path


def test_auto_budget_is_exact_and_calibrates_once(tiny_pair, tiny_perturbed_draft, cache_dir: Path) -> None:
    target, draft = load_model(tiny_pair[0]), load_model(tiny_perturbed_draft)
    ids = [1, 30, 31, 32, 33, 34]
    want = [t for s in Engine(target, None, EngineConfig(budget=1), None).generate(ids, 40) for t in s]
    engine = Engine(target, draft, EngineConfig(**budget_options("auto", 64)), SpecExecBuilder())
    got = [t for s in engine.generate(ids, 40) for t in s]
    assert got == want
    path = default_cost_path(cost_fingerprint(target))
    assert path.is_file()
    sizes = {s.tree_size for s in engine.stats.steps}
    assert all(1 <= n <= 64 for n in sizes)
    again = Engine(target, draft, EngineConfig(**budget_options("auto", 64)), SpecExecBuilder())
    mtime = path.stat().st_mtime_ns
    assert [t for s in again.generate(ids, 40) for t in s] == want
    assert path.stat().st_mtime_ns == mtime                       # loaded, not re-measured
