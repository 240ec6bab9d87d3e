"""Shared fixtures of the reliability tests: the CLI run in-process with an isolated layer-cache root (the
one-line-error assertion every user mistake must satisfy is tests/reliability/checks.py).

No fixture here is autouse: a test module opts in (`pytestmark = pytest.mark.usefixtures(...)` or by naming
the fixture), so tests in this folder that do not want them are unaffected. The session fixtures of
tests/conftest.py (tiny checkpoints) apply here too.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cli.main import main
from tests.reliability.checks import CliResult


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
