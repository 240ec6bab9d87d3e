"""The last steps: `specexec doctor` (`doctor`), then the `gpu`-marked tests (`gpu-tests`, `pytest -m gpu`)
with whatever is left of the deadline.

On CUDA every gpu test must pass: a failure, an error or a skip (a skip there means a missing package or a
wrong guard) fails the step. In CPU mode the same command proves that the suite collects without the
packages the image lacks (a dry run hides them) and that every gpu test is collected and skipped. The
doctor's gpu test is left out: the `doctor` step runs the same command and checks the same figures.

Does not know: what the tests check.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tools.gpu_check.registry import Context, step

DOCTOR_TEST = "tests/cli/test_doctor.py::test_gpu_doctor_is_fast_pinned_beats_pageable_and_the_gpu_equals_the_cpu"
PER_TEST_S = 150                 # pytest-timeout per test (the 70B link-rate test pins 3.4 GB and streams 12 layers)
MIN_GPU_TESTS = 20               # fewer collected means a file stopped being collected


def outcomes(xml: Path) -> dict:
    """Counts and the skips' and failures' names from a JUnit XML file."""
    root = ET.parse(xml).getroot()
    cases = list(root.iter("testcase"))
    out = {"collected": len(cases), "passed": 0, "failed": [], "errors": [], "skipped": {}, "slowest": []}
    for c in cases:
        name = f"{c.get('classname', '')}::{c.get('name')}"
        kinds = {child.tag: child for child in c}
        if "skipped" in kinds:
            out["skipped"][name] = (kinds["skipped"].get("message") or "")[:120]
        elif "failure" in kinds:
            out["failed"].append(name)
        elif "error" in kinds:
            out["errors"].append(name)
        else:
            out["passed"] += 1
    out["slowest"] = sorted(((round(float(c.get("time", 0)), 1), c.get("name")) for c in cases), reverse=True)[:6]
    return out


def from_log(text: str) -> dict:
    """Counts from `pytest -v` lines when the run was stopped before it wrote its XML."""
    seen = re.findall(r"^(tests/\S+) (PASSED|FAILED|ERROR|SKIPPED)", text, re.M)
    return {"collected": None, "passed": sum(s == "PASSED" for _, s in seen),
            "failed": [n for n, s in seen if s == "FAILED"], "errors": [n for n, s in seen if s == "ERROR"],
            "skipped": {n: "" for n, s in seen if s == "SKIPPED"}, "stopped": True}


@step("doctor", budget_s=20)
def doctor(ctx: Context) -> None:
    """`specexec doctor --json`: pinned/pageable host->GPU GB/s, disk GB/s, bitsandbytes, a tiny exact run."""
    io_mb, h2d_mb = (256, 512) if ctx.cuda else (32, 64)
    cmd = [sys.executable, "-m", "cli.main", "doctor", "--json", "--cache-dir", str(ctx.tmp), "--io-mb", str(io_mb),
           "--h2d-mb", str(h2d_mb)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=max(ctx.budget_s - 5, 10))
    sys.stdout.write(run.stdout[-4000:])
    sys.stderr.write(run.stderr[-4000:])
    ctx.check("doctor exits 0", run.returncode == 0, run.returncode, 0)
    r = json.loads(run.stdout.strip().splitlines()[-1])
    c, t = r["cuda"], r["tiny_model"]
    ctx.figure("report", {"h2d_gbps": c.get("h2d_gbps"), "disk": {k: r["disk"].get(k) for k in
                          ("read_gbps", "o_direct", "stand_ins")}, "bitsandbytes": r["bitsandbytes"],
                          "tiny_model": t})
    ctx.check("tiny model: every run equals the CPU reference", t["ok"], t["equal"], "all equal")
    if ctx.cuda:
        h = c["h2d_gbps"]
        ctx.check("pinned host->GPU beats pageable", h["pinned"] > h["pageable"], h, "pinned > pageable")
        ctx.check("bitsandbytes' CUDA kernels run", r["bitsandbytes"]["cuda_kernels"] is True,
                  r["bitsandbytes"], "cuda_kernels true")


@step("gpu-tests", budget_s=240)
def gpu_tests(ctx: Context) -> None:
    """`pytest -m gpu`: on CUDA every gpu test passes (none skipped); on a CPU all collect and skip."""
    xml = ctx.tmp / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "-p", "no:cacheprovider", "-v", "-rs",
           f"--timeout={PER_TEST_S}", "--deselect", DOCTOR_TEST, f"--junitxml={xml}", "tests"]
    print("$ " + " ".join(cmd), flush=True)
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=max(ctx.budget_s - 10, 20))
        log, code = run.stdout + run.stderr, run.returncode
    except subprocess.TimeoutExpired as e:
        log, code = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), None
    sys.stdout.write(log[-20000:])
    r = outcomes(xml) if xml.is_file() else from_log(log)
    modules = {n: m for n, m in r["skipped"].items() if n.startswith("::")}   # files skipped whole (a package
    r["skipped"] = {n: m for n, m in r["skipped"].items() if n not in modules}  # the image lacks), no gpu test
    r["skipped_files"] = sorted(n.strip(":") for n in modules)
    if not ctx.cuda:
        r["skipped"] = len(r["skipped"])
    ctx.figure("tests", r)
    ctx.figure("exit_code", code)
    ctx.check("pytest finished in time", code is not None, code, f"within {ctx.budget_s:.0f} s")
    if code is not None:
        ctx.check("collected and ran (exit 2: collection stopped; 5: nothing collected)", code in (0, 1), code,
                  "0 or 1")
    ctx.check("no test failed or errored", not r["failed"] and not r["errors"], r["failed"] + r["errors"], [])
    if r.get("collected") is not None:
        ctx.check("every gpu test file collected", r["collected"] >= MIN_GPU_TESTS, r["collected"],
                  f">= {MIN_GPU_TESTS}")
    if ctx.cuda:
        ctx.check("no gpu test skipped on CUDA", not r["skipped"], r["skipped"], {})
        ctx.check("gpu tests ran", r["passed"] > 0, r["passed"], "> 0")
    else:
        ctx.check("on a CPU every gpu test skips", r["passed"] == 0 and r["skipped"] == r["collected"] - len(modules),
                  {"passed": r["passed"], "skipped": r["skipped"]}, "all skipped")
