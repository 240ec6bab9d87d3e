"""`specexec plan` says what --budget auto starts at and the planned seconds of that pass (torch-free pick)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from specexec.checkpoints.catalog import SHIPPED_CONFIGS
from cli.main import main
from specexec.tuning.budget import BudgetTuner
from specexec.tuning.plan_pick import auto_start, budget_grid

CONFIGS = SHIPPED_CONFIGS
HEADLINE = ["plan", "--model", str(CONFIGS / "llama-3.1-70b-instruct"), "--draft",
            str(CONFIGS / "llama-3.1-8b-instruct"), "--quant", "nf4", "--draft-quant", "nf4", "--ram-budget", "64GB",
            "--gpu-memory", "24GB", "--budget", "auto"]


def test_the_pick_is_the_tuners_first_budget() -> None:
    for top in (1, 8, 100, 1024):
        assert auto_start(top, 1.0).budget == BudgetTuner(top).budget
    assert budget_grid(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_plan_pick_imports_no_torch() -> None:
    code = "import sys, specexec.tuning.plan_pick; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_shows_where_auto_starts_for_the_70b_headline(capsys) -> None:
    assert main([*HEADLINE, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    auto = out["auto_budget"]
    assert auto["start"] == 16 and auto["max"] == 1024
    assert auto["predicted_seconds_per_pass"] == out["predicted_seconds_per_pass"] > 0
    assert main(HEADLINE) == 0
    text = capsys.readouterr().out
    assert f"--budget auto starts at budget 16 (of 1..1024): predicted {auto['predicted_seconds_per_pass']:.3f} s" in text
    assert main(HEADLINE[:HEADLINE.index("--draft")] + HEADLINE[HEADLINE.index("--quant"):-2] + ["--json"]) == 0
    assert "auto_budget" not in json.loads(capsys.readouterr().out)          # no draft: nothing to tune
