"""specexec's public API: `specexec.__all__` is exactly the list its docstring documents, every name resolves
to the object in its home module, `import specexec` alone imports no torch, and the docstring's example runs."""
from __future__ import annotations

import doctest
import importlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import specexec

ROOT = Path(__file__).resolve().parents[1]


def documented_names() -> list[str]:
    """The names of the docstring's "Public API" list, in order (lines "- `Name`: ...")."""
    section = specexec.__doc__.split("Public API", 1)[1].split("Example", 1)[0]
    return re.findall(r"^- `(\w+)`:", section, flags=re.MULTILINE)


def test_all_is_exactly_what_the_docstring_lists() -> None:
    names = documented_names()
    assert len(names) >= 10                                    # the parse found the list, not nothing
    assert specexec.__all__ == names


@pytest.mark.parametrize("name", specexec.__all__)
def test_every_public_name_is_its_home_modules_object(name: str) -> None:
    home = importlib.import_module(specexec._WHERE[name])
    assert getattr(specexec, name) is getattr(home, name)


def test_star_import_gives_every_name_and_unknown_names_fail() -> None:
    scope: dict = {}
    exec("from specexec import *", scope)
    assert set(specexec.__all__) <= set(scope)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        specexec.Nope


def test_importing_the_package_imports_no_torch() -> None:
    code = "import sys, specexec; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    code = "import sys, specexec; specexec.Engine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"                        # the check above can tell the difference


def test_docstring_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # the example's mkdtemp() lands in tmp_path
    result = doctest.testmod(specexec, verbose=False, report=True)
    assert result.attempted >= 10 and result.failed == 0
    # the example's own directory (torch may add its own, e.g. torchinductor_<user>, to the same tempdir)
    assert any((d / "target" / "config.json").is_file() for d in tmp_path.iterdir())
