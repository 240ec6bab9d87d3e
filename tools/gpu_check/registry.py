"""The steps of the GPU check: one function per step, registered with its time budget and what it needs.

A step is `fn(ctx: Context) -> None`: it measures, records figures (`ctx.figure`) and checks (`ctx.check`: a
figure against its bound), or raises `Skip(reason)`. `cuda=True` marks a step that only means something on a
GPU: in CPU mode (no CUDA, or --cpu / --dry-run) it is skipped with `why_cuda` as its reason; a step without
it runs on either device and looks at `ctx.cuda`. Steps run in the order they were registered (the step
modules are imported in STEP_MODULES' order), each in its own process, under one deadline (driver.py).

To add a step (an MoE pass, a new family, `--experts cpu`): write `@step("name", budget_s=..)` over a
function in a steps_*.py module (a new module goes into STEP_MODULES), keep it within its budget on an H200,
and keep the budgets' sum under the deadline (tests/tools/test_gpu_check.py checks it).

Does not know: how steps run (driver.py, child.py), what any step measures.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEADLINE_S = 480                 # the whole check, wheels installed (a `run` call's limit: 600 s leaves a margin)
TESTS_MIN_S = 240                # what the last step (the gpu tests) gets at least if every other step is slow
STEP_MODULES = ("tools.gpu_check.steps_basic", "tools.gpu_check.steps_draft", "tools.gpu_check.steps_exact",
                "tools.gpu_check.steps_stream", "tools.gpu_check.steps_moe", "tools.gpu_check.steps_tests")


class Skip(Exception):
    """A step that cannot run here says why (the reason goes into the summary)."""


@dataclass
class Context:
    """What a step gets: the device it runs on, where to write, and where its results go."""

    cuda: bool                                   # a CUDA device is there and the check is not in CPU mode
    out: Path                                    # the check's output folder ($OUT): a step adds no files there
    tmp: Path                                    # scratch space of this step, removed afterwards
    budget_s: float = 60.0                       # seconds this step has before the driver stops it
    figures: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def figure(self, name: str, value: Any) -> Any:
        self.figures[name] = value
        return value

    def check(self, name: str, ok: bool, value: Any = None, bound: Any = None) -> bool:
        """Record one verdict: `value` against `bound` (both shown in the summary)."""
        self.checks.append({"check": name, "ok": bool(ok), "value": value, "bound": bound})
        print(f"  check {name}: {'ok' if ok else 'FAILED'} (value {value!r}, bound {bound!r})", flush=True)
        return bool(ok)


@dataclass(frozen=True)
class Step:
    name: str
    fn: Callable[[Context], None]
    budget_s: float
    cuda: bool = False
    why_cuda: str = ""

    @property
    def doc(self) -> str:
        return " ".join((self.fn.__doc__ or "").strip().split("\n\n")[0].split())


STEPS: dict[str, Step] = {}


def step(name: str, budget_s: float, cuda: bool = False, why_cuda: str = "") -> Callable:
    """Register `fn` as the step `name` (unique) with `budget_s` seconds at most."""
    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        if name in STEPS:
            raise ValueError(f"gpu-check step {name!r} is registered twice")
        if cuda and not why_cuda:
            raise ValueError(f"gpu-check step {name!r} needs CUDA: say why (why_cuda)")
        STEPS[name] = Step(name, fn, budget_s, cuda, why_cuda)
        return fn
    return register


def all_steps() -> list[Step]:
    """Every registered step, in order (importing the step modules registers them; $GPU_CHECK_STEP_MODULES
    names more, comma-separated: the tests' fake steps)."""
    modules = [*STEP_MODULES, *(m for m in os.environ.get("GPU_CHECK_STEP_MODULES", "").split(",") if m)]
    for module in modules:
        importlib.import_module(module)
    order = {m: k for k, m in enumerate(modules)}
    steps = list(STEPS.values())                       # registration order within a module
    return sorted(steps, key=lambda s: order.get(s.fn.__module__, len(order)))
