"""The first second of a command: --version, --help and argument errors never import torch (they answer in a
fraction of a second), --help is short and --help-all has every option under its heading, and a mistyped flag,
command or catalogue name is answered with the closest one."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main

ROOT = Path(__file__).resolve().parents[2]
# Runs main(argv) in a fresh interpreter and prints whether torch (or transformers) got imported.
PROBE = ("import sys; from cli.main import main; code = main(sys.argv[1:]); "
         "print('IMPORTED', sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["generate", "--help"], ["chat", "--help"],
                                  ["serve", "--help"], ["bench", "--help"], ["plan", "--help"],
                                  ["generate", "--modle", "demo", "--prompt", "x"], ["chta"],
                                  ["demo", "--help"], ["doctor", "--help"], ["convert", "--help"], ["models", "--help"],
                                  ["cache", "ls", "--json"],
                                  ["generate", "--model", "m", "--prompt", "x", "--threads", "zero"]])
def test_version_help_and_argument_errors_import_no_torch(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(ROOT)}, timeout=120)
    assert "IMPORTED []" in proc.stdout, (argv, proc.stdout[-300:], proc.stderr[-500:])


def test_help_is_short_and_help_all_has_every_option_under_headings(capsys) -> None:
    assert main(["chat", "--help"]) == 0
    short = capsys.readouterr().out
    assert main(["chat", "--help-all"]) == 0
    full = capsys.readouterr().out
    assert len(short.splitlines()) < 60 < len(full.splitlines()), (len(short.splitlines()), len(full.splitlines()))
    assert "--model" in short and "--top-p" not in short and "specexec chat --help-all" in short
    for heading in ("model:", "engine:", "sampling:", "memory and offloading:"):
        assert f"\n{heading}\n" in full, heading
    assert "--top-p" in full and "sweep" not in full.split("--budget N|auto", 1)[1].split("--", 1)[0]
    assert main(["bench", "--help-all"]) == 0
    bench = " ".join(capsys.readouterr().out.split())
    assert "instead of the --budgets sweep" in bench


@pytest.mark.parametrize("argv, said", [
    (["generate", "--modle", "demo", "--prompt", "x"], "unknown option --modle; did you mean --model?"),
    (["generate", "--model", "demo", "--promt", "x"], "unknown option --promt; did you mean --prompt?"),
    (["chat", "--model", "demo", "--temprature", "1"], "unknown option --temprature; did you mean --temperature?"),
    (["chta"], "did you mean chat?"),
    (["plan", "--model", "llama-3.1-70b-instruc"], "error: model path llama-3.1-70b-instruc does not exist; did you "
                                                   "mean llama-3.1-70b-instruct (`specexec models` lists it)?"),
])
def test_a_typo_is_answered_with_the_closest_name(capsys, argv: list[str], said: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and "\n" not in err, err
