"""No two rooms of a package import each other, in either direction: inside specexec/, cli/, offload/ and
cpu_kernels/, a room is a folder (specexec/kv/) or a module at the package's top (specexec/config.py), and
for any two rooms A and B, A importing B and B importing A (any of their modules, lazy imports included) is
refused: a part both need moves down (into the lower room, or below both), or is passed in. This holds where
the file-count guide would push a module into the wrong room (a family's Rule into checkpoints/, say).
"""
from __future__ import annotations

from pathlib import Path

from tests.import_graph import import_graph

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("specexec", "cli", "offload", "cpu_kernels")


def room(module: str) -> str:
    """The room of a dotted module: its package and the next part (a folder or a top-level module)."""
    return ".".join(module.split(".")[:2])


def arrows_both_ways(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each pair of rooms importing each other, with one import each way (module:line)."""
    edges: dict[tuple[str, str], str] = {}
    for src, targets in graph.items():
        for dst, line in targets.items():
            a, b = room(src), room(dst)
            if a != b and a.split(".")[0] == b.split(".")[0]:
                edges.setdefault((a, b), f"{src}:{line} -> {dst}")
    return sorted(f"{a} <-> {b}: {edges[(a, b)]}; {edges[(b, a)]}" for a, b in edges if a < b and (b, a) in edges)


def test_no_two_rooms_import_each_other() -> None:
    found = arrows_both_ways(import_graph(ROOT, TOPS))
    assert not found, "rooms importing each other (move the shared part down):\n" + "\n".join(found)


def test_a_pair_is_seen_whichever_way_it_is_written() -> None:
    graph = {"specexec.kv.cache": {"specexec.network.model": 3}, "specexec.network.model": {"specexec.kv.cache": 9},
             "specexec.config": {"specexec.options": 1}}
    assert arrows_both_ways(graph) == ["specexec.kv <-> specexec.network: specexec.kv.cache:3 -> "
                                       "specexec.network.model; specexec.network.model:9 -> specexec.kv.cache"]
