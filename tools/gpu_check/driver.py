"""Run the registered steps, each in its own process, under one deadline; tee everything; write the summary.

Each step runs as `python -m tools.gpu_check.child ...` in a new process group, with a timeout of its budget or
what is left of the deadline less the last step's reserve, whichever is less (the last step, the gpu tests,
gets the rest);
on timeout the whole group is killed and the step reports `timeout`. A step's output streams into
OUT/steps.log (whole) and OUT/console.log (everything this driver prints); the console shows each step's
verdict. OUT/summary.json holds every step: status (ok | failed | skipped | timeout | error), the reason, its
seconds and budget, its figures and checks. It is rewritten after every step ("complete": false until the
last), so a run cut short leaves every finished step's figures there; the last lines printed are that JSON and
a table.
The output folder holds only these files (a `device` call brings back at most 8; see the README).

Does not know: what the steps measure (steps_*.py), how they are registered (registry.py).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from tools.gpu_check.registry import TESTS_MIN_S, Step

LOG_CAP = 4 << 20                # bytes of one step's output kept in steps.log (a pytest run can be long)


class Tee:
    """print() to the console and to OUT/console.log."""

    def __init__(self, path: Path) -> None:
        self.file: TextIO = open(path, "a", encoding="utf-8")

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()


def run_all(steps: list[Step], out: Path, cuda: bool, deadline_s: float, env: dict[str, str],
            machine: dict[str, Any], reserve: float = TESTS_MIN_S) -> dict[str, Any]:
    """Every step in order under the deadline -> the summary (also written to OUT/summary.json). `reserve`
    seconds of the deadline are kept for the last step (the gpu tests) whatever the others take."""
    out.mkdir(parents=True, exist_ok=True)
    say = Tee(out / "console.log")
    t0 = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    summary = _summary(results, cuda, deadline_s, t0, machine, complete=not steps)
    say(f"gpu-check: {len(steps)} steps, deadline {deadline_s:.0f} s, {'CUDA' if cuda else 'CPU mode'}")
    for k, st in enumerate(steps):
        left = deadline_s - (time.monotonic() - t0)
        last = k == len(steps) - 1
        limit = left if last else min(st.budget_s, left - (reserve if len(steps) > 1 else 0))
        say(f"== {st.name} (budget {limit:.0f} s): {st.doc}")
        if st.cuda and not cuda:
            results[st.name] = _skipped(st, f"CPU mode: {st.why_cuda}")
        elif limit < min(5, st.budget_s):
            results[st.name] = _skipped(st, f"the deadline ({deadline_s:.0f} s) is spent")
        else:
            results[st.name] = _run_child(st, limit, out, cuda, env)
        r = results[st.name]
        say(f"   {r['status']} in {r['seconds']:.1f} s" + (f": {r['reason']}" if r.get("reason") else ""))
        summary = _summary(results, cuda, deadline_s, t0, machine, complete=last)
        _write(out / "summary.json", summary)                  # as soon as known: a cut keeps what finished
    say("summary: " + json.dumps(summary, separators=(",", ":"), default=str))
    say(table(summary))
    return summary


def _summary(results: dict[str, dict[str, Any]], cuda: bool, deadline_s: float, t0: float,
             machine: dict[str, Any], complete: bool) -> dict[str, Any]:
    return {"ok": all(r["status"] in ("ok", "skipped") for r in results.values()),
            "failed": [n for n, r in results.items() if r["status"] not in ("ok", "skipped")],
            "complete": complete, "mode": "cuda" if cuda else "cpu", "deadline_s": deadline_s,
            "elapsed_s": round(time.monotonic() - t0, 1), "machine": machine, "steps": results}


def _write(path: Path, summary: dict[str, Any]) -> None:
    """summary.json replaced whole (written beside it, then renamed): a reader never sees half a file."""
    part = path.with_suffix(".json.part")
    part.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    os.replace(part, path)


def _skipped(st: Step, reason: str) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason, "seconds": 0.0, "budget_s": st.budget_s, "figures": {},
            "checks": []}


def _run_child(st: Step, limit: float, out: Path, cuda: bool, env: dict[str, str]) -> dict[str, Any]:
    """One step in its own process group; its output appended to OUT/steps.log."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{st.name}-") as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "tools.gpu_check.child", st.name, str(result_path), str(out), tmp,
               "cuda" if cuda else "cpu", f"{limit:.0f}"]
        log_path = out / "steps.log"
        with open(log_path, "ab") as log:
            log.write(f"\n===== {st.name}: {' '.join(cmd)}\n".encode())
            log.flush()
            start = os.fstat(log.fileno()).st_size
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            status, reason = _wait(proc, limit)
        _cap(log_path, start)
        result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    seconds = round(time.monotonic() - t0, 1)
    if status == "ok" and not result:
        status, reason = "error", f"the step's process exited with {proc.returncode} and wrote no result"
    if status != "ok":
        result = {**result, "status": status, "reason": reason}
    return {"figures": {}, "checks": [], **result, "seconds": seconds, "budget_s": st.budget_s}


def _cap(path: Path, start: int) -> None:
    """Keep at most LOG_CAP bytes of the step's output (from `start`): its first and last halves."""
    size = path.stat().st_size
    if size - start <= LOG_CAP:
        return
    with open(path, "r+b") as f:
        f.seek(size - LOG_CAP // 2)
        tail = f.read()
        f.seek(start + LOG_CAP // 2)
        f.write(b"\n[... output cut ...]\n" + tail)
        f.truncate()


def _wait(proc: subprocess.Popen, limit: float) -> tuple[str, str]:
    try:
        proc.wait(timeout=limit)
        return "ok", ""
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        return "timeout", f"stopped after {limit:.0f} s (its budget or the deadline)"


def table(summary: dict[str, Any]) -> str:
    """One line per step: status, seconds, and its checks (failed ones named)."""
    lines = [f"{'step':<14} {'status':<8} {'s':>6}  checks"]
    for name, r in summary["steps"].items():
        checks = r.get("checks", [])
        bad = [c["check"] for c in checks if not c["ok"]]
        text = f"{len(checks) - len(bad)}/{len(checks)} ok" + (f"; FAILED: {', '.join(bad)}" if bad else "")
        if r["status"] in ("skipped", "timeout", "error"):
            text = r.get("reason", "")[:90]
        lines.append(f"{name:<14} {r['status']:<8} {r['seconds']:>6.1f}  {text}")
    lines.append(f"gpu-check {'passed' if summary['ok'] else 'FAILED: ' + ', '.join(summary['failed'])} "
                 f"in {summary['elapsed_s']} s ({summary['mode']})")
    return "\n".join(lines)
