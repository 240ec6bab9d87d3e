"""A closed standard output is a normal end: `specexec ... | head -c 10` exits 0 and prints no error, whatever
the command. Each case writes into a real pipe whose reading end is already closed (EPIPE on the first write);
one runs the installed entry point in a subprocess, so Python's own flush at exit is covered too."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cli.main import main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "specexec/checkpoints/configs/llama-3.1-8b-instruct")


@contextlib.contextmanager
def reader_gone() -> Iterator[None]:
    """sys.stdout is a pipe nobody reads any more: every write raises BrokenPipeError. (Set inside the test:
    pytest's capture replaces sys.stdout again when the test body starts.)"""
    read, write = os.pipe()
    os.close(read)
    saved, sys.stdout = sys.stdout, os.fdopen(write, "w")
    try:
        yield
    finally:
        pipe, sys.stdout = sys.stdout, saved
        try:
            pipe.close()
        except OSError:
            pass


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("argv", [
    ["--help"], ["models"], ["models", "--json"], ["plan", "--model", CONFIG, "--ram-budget", "24GB", "--json"],
    ["plan", "--model", CONFIG, "--ram-budget", "24GB"],
], ids=["help", "models", "models-json", "plan-json", "plan"])
def test_closed_stdout_is_exit_0_and_no_error(capsys, argv) -> None:
    with reader_gone():
        assert main(argv) == 0
    assert "error" not in capsys.readouterr().err


@pytest.mark.parametrize("json_out", [False, True], ids=["streamed", "json"])
def test_generate_into_a_closed_pipe(capsys, tiny_llama, json_out) -> None:
    argv = ["generate", "--model", str(tiny_llama), "--no-draft", "--prompt", "hello", "--max-new-tokens", "4"]
    with reader_gone():
        assert main(argv + (["--json"] if json_out else [])) == 0
    assert "error" not in capsys.readouterr().err


def test_a_real_error_is_still_one_line_when_stdout_is_closed(capsys) -> None:
    with reader_gone():
        assert main(["plan", "--model", "/nonexistent/model"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.slow
def test_the_entry_point_exits_0_into_head(tmp_path: Path) -> None:
    """`specexec models | head -c 10`: the reader is gone before the command writes anything."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = "import sys; from cli.main import run; sys.argv = ['specexec', 'models']; run()"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Error" not in err and "error" not in err
