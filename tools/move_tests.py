"""Move tests/test_*.py into folders that mirror the packages (issue 17), idempotently: re-run it after a merge
brings a test file edited or added at its old place. `git mv`s each file, adds the folders' __init__.py, rewrites
`tests.test_x` imports and `tests/test_x.py` mentions in every tracked text file, and deepens the moved files'
`Path(__file__)` anchors by one folder. Run from the repository root: python3 tools/move_tests.py
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

FOLDERS: dict[str, list[str]] = {
    "core": ["attention", "builders", "builders_stats", "draft_graphs", "engine", "kv_stream", "model", "penalties",
             "prefill", "profiler", "sampling", "sampling_e2e", "syncs", "verify", "width"],
    "runtime": ["hub", "ledger", "loading", "models_yaml", "offloaded", "self_draft"],
    "tuning": ["acceptance", "auto_budget", "tuning"],
    "serving": ["serve"],
    "offload": ["awq_gptq", "cache", "facilities", "gguf", "pager", "planner", "quant", "quant_kernels",
                "sources_offload", "storage"],
    "cli": ["bench", "bench_attention", "bench_builders", "bench_context", "bench_endpoint", "chat", "cli", "doctor",
            "first_run", "plot"],
}
INIT = '"""Tests of {what}."""\n'
WHAT = {"core": "the decoding core (specexec/)", "runtime": "runtime assembly (specexec/runtime/)",
        "tuning": "measuring and tuning (specexec/tuning/)", "serving": "the HTTP server (specexec/serving/)",
        "offload": "weight offloading (offload/)", "cli": "the command line and bench (cli/, cli/bench/)"}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def move() -> dict[str, str]:
    """git mv every file still at its old place; returns {old module name: new dotted folder}."""
    where = {}
    for folder, names in FOLDERS.items():
        init = Path("tests", folder, "__init__.py")
        if not init.exists():
            init.parent.mkdir(exist_ok=True)
            init.write_text(INIT.format(what=WHAT[folder]))
            git("add", str(init))
        for name in names:
            old, new = Path("tests", f"test_{name}.py"), Path("tests", folder, f"test_{name}.py")
            if old.exists():
                git("mv", str(old), str(new))
            where[f"test_{name}"] = folder
    return where


def rewrite(where: dict[str, str]) -> None:
    """Imports and path mentions everywhere; Path(__file__) anchors in the moved files."""
    names = "|".join(sorted(where, key=len, reverse=True))
    dotted = re.compile(rf"\btests\.({names})\b")
    slashed = re.compile(rf"\btests/({names})\.py\b")
    for path in git("ls-files").split():
        p = Path(path)
        if p.suffix not in (".py", ".md", ".toml", ".txt", ".yaml", ".cfg") or not p.exists():
            continue
        text = p.read_text()
        new = dotted.sub(lambda m: f"tests.{where[m[1]]}.{m[1]}", text)
        new = slashed.sub(lambda m: f"tests/{where[m[1]]}/{m[1]}.py", new)
        if p.parent.name in FOLDERS and p.parent.parent.name == "tests" and p.name.startswith("test_"):
            new = anchors(new)
        if new != text:
            p.write_text(new)


def anchors(text: str) -> str:
    """One folder deeper: parents[1] -> parents[2]; Path(__file__).parent / "configs" -> the tests folder's."""
    text = text.replace("Path(__file__).resolve().parents[1]", "Path(__file__).resolve().parents[2]")
    return text.replace('Path(__file__).parent / "configs"', 'Path(__file__).resolve().parents[1] / "configs"')


if __name__ == "__main__":
    rewrite(move())
