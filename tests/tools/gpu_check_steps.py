"""Fake steps for tests/tools/test_gpu_check.py's driver test (loaded through $GPU_CHECK_STEP_MODULES): one passes,
one fails a check, one skips, one raises, one needs CUDA, one outlives its budget."""
from __future__ import annotations

import json
import time

from tools.gpu_check.registry import Context, Skip, step


@step("fake-ok", budget_s=20)
def ok(ctx: Context) -> None:
    """Passes, and says which steps OUT/summary.json held when it started (each is written as it ends)."""
    ctx.figure("answer", 42)
    summary = json.loads((ctx.out / "summary.json").read_text())
    ctx.figure("summary_had", [sorted(summary["steps"]), summary["complete"]])
    ctx.check("forty-two", True, 42, 42)


@step("fake-fails", budget_s=20)
def fails(ctx: Context) -> None:
    """Fails a check."""
    ctx.check("too slow", False, 3.0, 1.0)


@step("fake-skips", budget_s=20)
def skips(ctx: Context) -> None:
    """Skips."""
    raise Skip("nothing to measure here")


@step("fake-raises", budget_s=20)
def raises(ctx: Context) -> None:
    """Raises."""
    raise ValueError("broken step")


@step("fake-cuda", budget_s=20, cuda=True, why_cuda="it measures a GPU")
def needs_cuda(ctx: Context) -> None:
    """Needs CUDA."""


@step("fake-hangs", budget_s=2)
def hangs(ctx: Context) -> None:
    """Sleeps past its budget."""
    time.sleep(60)
