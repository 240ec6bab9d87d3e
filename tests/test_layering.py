"""The dependency rule `cli -> specexec -> offload -> cpu_kernels -> torch`, checked by reading imports with `ast`
(tests/import_graph.py).

cpu_kernels/ imports nothing of ours; offload/ imports neither specexec nor cli; specexec/ never imports cli. Every
import counts: top-level, inside functions, under TYPE_CHECKING, relative (`from .. import specexec`), and
string-literal dynamic imports (`importlib.import_module("cli.main")`, `__import__("cli")`). Packages that are empty
or not there yet pass.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import imported_modules

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN: dict[str, frozenset[str]] = {
    "cpu_kernels": frozenset({"offload", "specexec", "cli"}),
    "offload": frozenset({"specexec", "cli"}),
    "specexec": frozenset({"cli"}),
}


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """'module:line imports name' for each import that breaks the rule for module's top-level package."""
    banned = FORBIDDEN.get(module.split(".")[0], frozenset())
    return [f"{module}:{line} imports {name}" for line, name in imported_modules(source, module, is_package)
            if name.split(".")[0] in banned]


def package_violations(top: str, root: Path = ROOT) -> list[str]:
    out: list[str] = []
    for path in sorted((root / top).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out += violations(path.read_text(encoding="utf-8"), ".".join(parts), is_package)
    return out


@pytest.mark.parametrize("top", sorted(FORBIDDEN))
def test_package_respects_layering(top: str) -> None:
    bad = package_violations(top)
    assert not bad, f"{top}/ may not import {', '.join(sorted(FORBIDDEN[top]))}:\n" + "\n".join(bad)


def test_checker_finds_every_kind_of_import() -> None:
    source = """
import os, torch
import specexec.tree
from specexec import tree
from cli.main import run
from . import pager
from .. import specexec
from ..cli import chat
import importlib
importlib.import_module("cli.chat")
__import__("specexec")
def late():
    from specexec.engine import Engine
"""
    assert violations(source, "offload.pager") == [
        "offload.pager:3 imports specexec.tree",
        "offload.pager:4 imports specexec",
        "offload.pager:5 imports cli.main",
        "offload.pager:7 imports specexec",
        "offload.pager:8 imports cli",
        "offload.pager:10 imports cli.chat",
        "offload.pager:11 imports specexec",
        "offload.pager:13 imports specexec.engine",
    ]
    assert violations(source, "specexec.engine") == [
        "specexec.engine:5 imports cli.main",
        "specexec.engine:8 imports cli",
        "specexec.engine:10 imports cli.chat",
    ]
    assert violations(source, "cli.main") == []


def test_checker_resolves_relative_imports() -> None:
    assert imported_modules("from . import pager", "offload.streaming.tiers") == [(1, "offload.streaming.pager")]
    assert imported_modules("from .pager import LayerPager", "offload", is_package=True) == [(1, "offload.pager")]
    assert imported_modules("from ..tree import TokenTree", "specexec.builders.chain") == [(1, "specexec.tree")]
    assert violations("from ... import cli", "specexec.builders.chain") == ["specexec.builders.chain:1 imports cli"]
    with pytest.raises(ValueError, match="above the top-level"):
        imported_modules("from .... import x", "specexec.builders.chain")


def test_checker_scans_files(tmp_path: Path) -> None:
    (tmp_path / "offload" / "sub").mkdir(parents=True)
    (tmp_path / "offload" / "__init__.py").write_text("from .sub import thing\n")
    (tmp_path / "offload" / "sub" / "bad.py").write_text("import torch\n\nfrom ...specexec import model\n")
    assert package_violations("offload", tmp_path) == ["offload.sub.bad:3 imports specexec"]
    assert package_violations("specexec", tmp_path) == []          # absent package: nothing to check


def imports_of_test_modules(root: Path = ROOT) -> list[str]:
    """'module:line imports name' for each import, in tests/, of a test module or a conftest."""
    from tests.import_graph import imports, module_files

    out = []
    for module, (path, is_package) in module_files(root, ("tests",)).items():
        for imp in imports(path.read_text(encoding="utf-8"), module, is_package):
            for name in [f"{imp.base}.{n}" for n in imp.names] + [imp.base]:
                last = name.split(".")[-1]
                if name.startswith("tests.") and (last.startswith("test_") or last == "conftest"):
                    out.append(f"{module}:{imp.line} imports {name}")
    return out


def test_tests_import_helpers_never_test_modules() -> None:
    """A helper two test files share lives in a helper module (tests/tiny_models.py, tests/sampling/chi2.py, ...):
    importing a test module runs its collection-time code and ties one test file's refactor to another's."""
    bad = imports_of_test_modules()
    assert not bad, "import the helper from a helper module instead:\n" + "\n".join(bad)


def test_the_test_module_rule_sees_each_kind(tmp_path: Path) -> None:
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    (tmp_path / "tests" / "sub" / "test_a.py").write_text(
        "from tests.sub.test_b import helper\nfrom tests.sub import conftest\nfrom tests.sampling.chi2 import p\n"
        "def f():\n    from tests.sub.conftest import x\n")
    assert imports_of_test_modules(tmp_path) == ["tests.sub.test_a:1 imports tests.sub.test_b",
                                                 "tests.sub.test_a:2 imports tests.sub.conftest",
                                                 "tests.sub.test_a:5 imports tests.sub.conftest"]
