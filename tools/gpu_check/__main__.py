"""`tools/gpu-check`: the GPU check in one run on a bare lent machine (see tools/gpu_check/__init__.py).

    tools/gpu-check [--out DIR] [--deadline S] [--only a,b] [--cpu] [--as-image] [--dry-run] [--list]
                    [--budget-scale X]

--cpu runs in CPU mode even with CUDA (every step that can run on a CPU runs; the others are skipped, saying
why); --as-image hides the packages the lent image lacks (image.py), so this machine collects and imports as
that one would; --dry-run is both. The budgets are a lent GPU machine's (16 idle cores); in CPU mode they are
multiplied by --budget-scale (default CPU_SCALE: a busy 2-core machine imports torch alone in ~10 s), the
deadline and the tests' reserve too. The exit code is the number of steps that did not pass.

Does not know: what a step measures (steps_*.py).
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import os
import platform
import sys
from pathlib import Path

from tools.gpu_check import image
from tools.gpu_check.driver import run_all
from tools.gpu_check.registry import DEADLINE_S, TESTS_MIN_S, all_steps

CPU_SCALE = 4.0                  # CPU mode's budgets: this many times the GPU machine's

HIDE = Path(__file__).resolve().parent / "hide"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tools/gpu-check", description="The GPU check, one deadline, one summary.")
    p.add_argument("--out", help="output folder (default: $OUT, else ./gpu-check-out)")
    p.add_argument("--deadline", type=float, default=DEADLINE_S, help=f"seconds for everything (default {DEADLINE_S})")
    p.add_argument("--only", help="comma-separated step names (default: all)")
    p.add_argument("--cpu", action="store_true", help="CPU mode even where CUDA is available")
    p.add_argument("--as-image", action="store_true", help="hide the packages the lent image lacks")
    p.add_argument("--dry-run", action="store_true", help="--cpu --as-image")
    p.add_argument("--list", action="store_true", help="list the steps and their budgets")
    p.add_argument("--budget-scale", type=float, help=f"multiply every budget and the deadline (default 1 on CUDA, "
                   f"{CPU_SCALE:g} in CPU mode)")
    return p.parse_args(argv)


def machine(cuda: bool) -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "host": platform.node(), "cpus": os.cpu_count()}
    if cuda:
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def child_env(as_image: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    if as_image:
        _, optional = image.missing()
        env["SPECEXEC_HIDE_PACKAGES"] = ",".join(image.import_name(p) for p in optional)
        env["PYTHONPATH"] = os.pathsep.join([str(HIDE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    steps = all_steps()
    if ns.list:
        for s in steps:
            print(f"{s.name:<14} {s.budget_s:>4.0f} s  {'CUDA ' if s.cuda else 'both '} {s.doc}")
        return 0
    if ns.only:
        wanted = set(ns.only.split(","))
        unknown = wanted - {s.name for s in steps}
        if unknown:
            print(f"tools/gpu-check: unknown step(s) {sorted(unknown)}; see --list", file=sys.stderr)
            return 2
        steps = [s for s in steps if s.name in wanted]
    import torch

    cuda = torch.cuda.is_available() and not (ns.cpu or ns.dry_run)
    out = Path(ns.out or os.environ.get("OUT") or "gpu-check-out")
    scale = ns.budget_scale if ns.budget_scale is not None else (1.0 if cuda else CPU_SCALE)
    steps = [replace(s, budget_s=s.budget_s * scale) for s in steps]
    summary = run_all(steps, out, cuda, ns.deadline * scale, child_env(ns.as_image or ns.dry_run), machine(cuda),
                      reserve=TESTS_MIN_S * scale)
    return len(summary["failed"])


if __name__ == "__main__":
    sys.exit(main())
