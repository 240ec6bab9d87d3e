"""Reading imports with `ast`: a helper of tests/test_layering.py (who may import whom) and
tests/test_import_cycles.py (no module reaches itself).

Every import counts: top-level, inside functions, under TYPE_CHECKING, relative (`from .. import specexec`),
and string-literal dynamic imports (`importlib.import_module("cli.main")`, `__import__("cli")`).
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Import:
    """One import statement's target: `base` is the absolute module named after `from` (or after `import`),
    `names` what `from base import ...` takes from it (() for `import base`); bare: `from . import x`, whose
    names are modules of `base`."""

    line: int
    base: str
    names: tuple[str, ...] = ()
    bare: bool = False


def imports(source: str, module: str, is_package: bool = False) -> Iterator[Import]:
    """Every import in `source`, the code of module `module` (dotted; is_package: it is a package's
    __init__), relative ones made absolute."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source, filename=module)):
        if isinstance(node, ast.Import):
            yield from (Import(node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = []
            if node.level:
                up = node.level - 1
                if up > len(package):
                    raise ValueError(f"{module}:{node.lineno}: relative import goes above the top-level package")
                base = package[:len(package) - up]
            names = tuple(alias.name for alias in node.names)
            yield Import(node.lineno, ".".join(base + (node.module.split(".") if node.module else [])), names,
                         bare=not node.module)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and _call_name(node.func) in ("import_module", "__import__")):
            yield Import(node.lineno, node.args[0].value)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in `source`; each name of a bare `from . import x`
    counts as a module."""
    found: list[tuple[int, str]] = []
    for imp in imports(source, module, is_package):
        found += [(imp.line, f"{imp.base}.{n}" if imp.base else n) for n in imp.names] if imp.bare \
            else [(imp.line, imp.base)]
    return found


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def module_files(root: Path, tops: tuple[str, ...]) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's __init__) for every .py under root/top."""
    out: dict[str, tuple[Path, bool]] = {}
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph(root: Path, tops: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """module -> {module of the same tree it imports: the first line doing so}. `from a.b import c` is an edge
    to a.b.c when that is a module, else to a.b; importing a.b.c does not count as importing the packages above
    it (their __init__ runs first, but only what they import themselves makes their edges)."""
    files = module_files(root, tops)
    graph: dict[str, dict[str, int]] = {m: {} for m in files}
    for module, (path, is_package) in files.items():
        for imp in imports(path.read_text(encoding="utf-8"), module, is_package):
            subs = [f"{imp.base}.{n}" for n in imp.names if f"{imp.base}.{n}" in files]
            targets = subs + ([imp.base] if len(subs) < len(imp.names) or not imp.names else [])
            for target in targets:
                if target in files and target != module:      # a package naming its own attributes: no edge
                    graph[module].setdefault(target, imp.line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One import cycle per strongly connected group of modules (Tarjan's algorithm, iterative), as the
    modules along the shortest way round from the group's first module (first == last)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return [_shortest_loop(graph, group) for group in sorted(groups)]


def _shortest_loop(graph: dict[str, dict[str, int]], group: list[str]) -> list[str]:
    """The shortest path from group[0] back to itself inside the group (breadth first)."""
    first, members = group[0], set(group)
    previous: dict[str, str] = {}
    frontier = [first]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in members:
                    continue
                if child == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(previous[path[-1]])
                    return [*reversed(path), first]
                if child not in previous:
                    previous[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no loop through {first}")
