"""Shared fixtures of the reliability tests: the CLI run in-process with an isolated layer-cache root, and the
one-line-error assertion every user mistake must satisfy.

No fixture here is autouse: a test module opts in (`pytestmark = pytest.mark.usefixtures(...)` or by naming
the fixture), so tests in this folder that do not want them are unaffected. The session fixtures of
tests/conftest.py (tiny checkpoints) apply here too.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from cli.main import main


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy 2-core machine one thread keeps them fast."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A layer-cache root that does not exist yet, named by --cache-dir / --out AND by $SPECEXEC_CACHE (so a
    path that forgets the flag still lands here, never in ~/.cache). XDG_CACHE_HOME points into tmp too."""
    root = tmp_path / "layer-cache"
    monkeypatch.setenv("SPECEXEC_CACHE", str(root))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return root


@pytest.fixture
def cli(capsys: pytest.CaptureFixture, one_thread):
    """cli(*argv) -> CliResult: `specexec argv` run in-process, stdout and stderr captured."""
    def run(*argv: str) -> CliResult:
        capsys.readouterr()                                  # drop anything printed before
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)
    return run


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
