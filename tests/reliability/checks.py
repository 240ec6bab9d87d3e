"""What every user mistake must satisfy, checked (a helper of the reliability tests; the fixtures that run the
CLI are tests/reliability/conftest.py): one line `error: ...` and exit 2, nothing cached, and private copies of
session checkpoints a test may break.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass
class CliResult:
    code: int
    out: str
    err: str


def assert_one_line_error(result: CliResult, *needles: str, code: int = 2) -> str:
    """Exit `code` (a user error: 2), nothing on stdout, stderr exactly one line `error: ...` without a
    traceback or raw control characters, containing each needle (case-insensitive). Returns the line."""
    err = result.err
    assert result.code == code, (result.code, err)
    assert "Traceback" not in err, err
    assert err.endswith("\n") and err.count("\n") == 1, repr(err)
    line = err.rstrip("\n")
    assert line.startswith("error: "), line
    assert not any(ord(c) < 32 or ord(c) == 127 for c in line), repr(line)
    assert result.out == "", result.out
    for needle in needles:
        assert needle.lower() in line.lower(), (needle, line)
    return line


def assert_nothing_cached(*roots: Path) -> None:
    """No file (not even a lock or a temporary directory) under any cache root: absent or empty."""
    for root in roots:
        if root.exists():
            left = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
            assert not left, f"{root} holds {left}"


def copy_checkpoint(src: Path, dest: Path) -> Path:
    """A private copy of a session checkpoint that a test may break."""
    shutil.copytree(src, dest)
    return dest


def checkpoint_argv(mode: str, model: Path, cache: Path) -> list[str]:
    """The CLI run that meets a (broken) checkpoint `model` in `mode`: generate resident, streamed from the
    SSD tier (offload), nf4 in the RAM tier under a budget (ram-budget), or convert."""
    if mode == "convert":
        return ["convert", "--model", str(model), "--quant", "nf4", "--out", str(cache), "--no-progress"]
    argv = ["generate", "--model", str(model), "--no-draft", "--prompt", "Hello", "--max-new-tokens", "2",
            "--cache-dir", str(cache)]
    if mode == "ram-budget":                     # nf4 layers in the RAM tier, under an explicit budget
        return argv + ["--quant", "nf4", "--offload", "ram", "--ram-budget", "256MB"]
    return argv + (["--quant", "none", "--offload", "ssd"] if mode == "offload" else [])
