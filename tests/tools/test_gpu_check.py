"""tools/gpu-check without a GPU: the steps' budgets fit the deadline with the gpu tests' reserve; the driver
runs each step in its own process (ok, failed check, skip, error, CUDA-only in CPU mode, past its budget:
killed) and writes a summary of every figure into at most a few flat files; the image's missing packages are
what travels (bitsandbytes) or is hidden in a dry run (the serve extra...); the hiding works; the parsers of
pytest's results and of a wheel's requirements."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tools.gpu_check import image, registry
from tools.gpu_check.driver import run_all
from tools.gpu_check.steps_tests import from_log, outcomes
from tools.gpu_check.wheels import requires

ROOT = Path(__file__).resolve().parents[2]


def test_budgets_fit_the_deadline_and_every_step_says_what_it_does() -> None:
    steps = registry.all_steps()
    names = [s.name for s in steps]
    assert names[-1] == "gpu-tests" and {"syncs", "graphs-ssd", "nf4-draft", "greedy", "ram-stream", "memory",
                                         "doctor", "env"} <= set(names)
    assert sum(s.budget_s for s in steps[:-1]) + registry.TESTS_MIN_S <= registry.DEADLINE_S <= 480
    assert registry.TESTS_MIN_S >= 240 and steps[-1].budget_s >= registry.TESTS_MIN_S
    assert all(s.doc and (s.why_cuda or not s.cuda) for s in steps)


@pytest.mark.slow          # one subprocess per step of the driver (~30 s on 2 busy cores)
def test_the_driver_runs_each_step_apart_under_the_deadline(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GPU_CHECK_STEP_MODULES", "tests.tools.gpu_check_steps")
    import tests.tools.gpu_check_steps  # noqa: F401 -- registers the fake steps here too

    steps = [s for s in registry.all_steps() if s.name.startswith("fake-")]
    steps = [steps[-1], *steps[:-1]]                                  # the last step gets the rest: not this one
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    summary = run_all(steps, tmp_path, False, 60, env, {"host": "test"}, reserve=0)
    assert time.monotonic() - t0 < 40                                 # the hanging step was stopped at 2 s
    got = {name: r["status"] for name, r in summary["steps"].items()}
    assert got == {"fake-ok": "ok", "fake-fails": "failed", "fake-skips": "skipped", "fake-raises": "error",
                   "fake-cuda": "skipped", "fake-hangs": "timeout"}
    r = summary["steps"]
    assert r["fake-ok"]["figures"] == {"answer": 42, "summary_had": [["fake-hangs"], False]} and r["fake-fails"]["checks"][0]["ok"] is False
    assert "CPU mode: it measures a GPU" in r["fake-cuda"]["reason"] and "broken step" in r["fake-raises"]["reason"]
    assert summary["failed"] == ["fake-hangs", "fake-fails", "fake-raises"] and summary["ok"] is False
    assert summary["complete"] is True
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == json.loads(json.dumps(summary["steps"]))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["console.log", "steps.log", "summary.json"]        # flat, few: what a device call returns
    assert "ValueError: broken step" in (tmp_path / "steps.log").read_text()
    assert "fake-hangs     timeout" in (tmp_path / "console.log").read_text()


def test_what_travels_and_what_a_dry_run_hides() -> None:
    required, optional = image.missing()
    assert required == ["bitsandbytes"]                     # NF4 on CUDA: the one wheel the image lacks
    assert {"uvicorn", "starlette", "openai", "anthropic", "gguf", "pexpect", "pydantic", "llguidance",
            "openai-agents"} == set(optional)
    assert {"torch", "transformers", "safetensors", "pytest-xdist", "hypothesis"} <= image.IMAGE
    env = dict(os.environ, SPECEXEC_HIDE_PACKAGES="json_hidden_probe,uvicorn",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tools/gpu_check/hide"), os.environ.get("PYTHONPATH", "")]))
    code = "import json\ntry:\n    import uvicorn\nexcept ModuleNotFoundError as e:\n    print('hidden', e.name)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "hidden uvicorn", out.stderr


def test_results_parsers(tmp_path: Path) -> None:
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.a" name="t1" time="1.5"/>'
                   '<testcase classname="tests.a" name="t2"><skipped message="no CUDA"/></testcase>'
                   '<testcase classname="tests.b" name="t3"><failure message="x"/></testcase>'
                   '<testcase classname="" name="tests.c"><skipped message="collection skipped"/></testcase>'
                   '</testsuite></testsuites>')
    r = outcomes(xml)
    assert r["collected"] == 4 and r["passed"] == 1 and r["failed"] == ["tests.b::t3"]
    assert r["skipped"] == {"tests.a::t2": "no CUDA", "::tests.c": "collection skipped"}
    log = "tests/x.py::a PASSED [ 50%]\ntests/x.py::b FAILED [100%]\n"
    assert from_log(log)["passed"] == 1 and from_log(log)["failed"] == ["tests/x.py::b"]
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nRequires-Dist: torch<3,>=2.4\n"
                   "Requires-Dist: Numpy>=1.17\nRequires-Dist: pandas; extra == \"benchmark\"\n")
    assert requires(wheel) == ["torch", "numpy"]
