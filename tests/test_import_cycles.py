"""No import cycles among specexec/, cli/, offload/ and cpu_kernels/, lazy imports included: an import inside a
function still closes a circle (whichever module runs first, the other finds it half-initialised), and hiding one
behind a function is how such circles grow. Every import counts, as for the layering rule (tests/import_graph.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import cycles, import_graph

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("specexec", "cli", "offload", "cpu_kernels")


def _describe(loop: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(loop, loop[1:])) + f" -> {loop[-1]}"


def test_no_module_imports_itself_round_a_circle() -> None:
    graph = import_graph(ROOT, TOPS)
    found = cycles(graph)
    assert not found, "import cycles (break each: move the shared part down, or pass it in):\n" + \
        "\n".join(_describe(loop, graph) for loop in found)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_behind_a_lazy_import_is_found(tmp_path: Path) -> None:
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import thing\n",
                      "pkg/b.py": "thing = 1\n\ndef late():\n    from pkg import a\n    return a\n",
                      "pkg/c.py": "import pkg.a\n"})
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.b"] == {"pkg.a": 4} and graph["pkg.c"] == {"pkg.a": 1}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert "pkg.a (line 1) -> pkg.b (line 4) -> pkg.a" == _describe(cycles(graph)[0], graph)


@pytest.mark.parametrize("late", ["from ..x import sub", "from top.x import sub", "import top.x.sub",
                                  "importlib.import_module('top.x.sub')", "__import__('top.x.sub')"])
def test_relative_plain_and_dynamic_imports_close_a_circle(tmp_path: Path, late: str) -> None:
    _write(tmp_path, {"top/__init__.py": "", "top/x/__init__.py": "", "top/x/sub.py": "from top.y.tail import f\n",
                      "top/y/__init__.py": "", "top/y/tail.py": f"import importlib\n\ndef f():\n    {late}\n"})
    assert cycles(import_graph(tmp_path, ("top",))) == [["top.x.sub", "top.y.tail", "top.x.sub"]]


def test_importing_a_module_is_not_importing_the_packages_above_it(tmp_path: Path) -> None:
    _write(tmp_path, {"p/__init__.py": "def api():\n    from p.impl import run\n    return run\n",
                      "p/impl.py": "from p.util import helper\n", "p/util.py": "helper = 1\n"})
    assert cycles(import_graph(tmp_path, ("p",))) == []
    _write(tmp_path, {"p/util.py": "from p import api\n"})           # now util needs the package's own name
    assert cycles(import_graph(tmp_path, ("p",))) == [["p", "p.impl", "p.util", "p"]]


def _reach(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for child in graph[todo.pop()]:
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def test_the_planner_never_reaches_the_engine_and_the_configs_no_builder() -> None:
    """specexec/planning/ sizes a run from config.json alone: no import of it (lazy ones included, at any depth)
    reaches the engine or a builder; config and options reach no builder, no verifier, no model."""
    graph = import_graph(ROOT, TOPS)
    for module in (m for m in graph if m.startswith("specexec.planning.")):
        bad = {m for m in _reach(graph, module) if m == "specexec.decoding.engine" or m.startswith("specexec.builders")}
        assert not bad, f"{module} reaches {sorted(bad)}"
    for module in ("specexec.config", "specexec.options"):
        bad = {m for m in _reach(graph, module)
               if m.startswith("specexec.builders") or m in ("specexec.acceptance.rules", "specexec.network.model", "specexec.decoding.engine")}
        assert not bad, f"{module} reaches {sorted(bad)}"
