"""The first step: what is installed and whether the project imports (`env`).

Does not know: the measuring steps (steps_draft.py, steps_exact.py, steps_stream.py, steps_tests.py).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import shutil
import subprocess
import sys

from tools.gpu_check.registry import Context, step

TORCH_FLOOR = (2, 5)             # pyproject's floor (SDPAParams with enable_gqa)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import(module: str) -> str | None:
    """None when `module` imports, else the error in one line."""
    try:
        importlib.import_module(module)
        return None
    except Exception as e:                              # noqa: BLE001 -- the failure is the finding
        return f"{type(e).__name__}: {e}"


@step("env", budget_s=10)
def env(ctx: Context) -> None:
    """Versions (python, torch, CUDA, transformers, bitsandbytes...), the GPU, and that the project imports."""
    import torch

    for dist in ("torch", "transformers", "huggingface-hub", "tokenizers", "safetensors", "bitsandbytes", "numpy",
                 "pytest", "pytest-xdist", "pytest-timeout", "hypothesis", "scipy", "matplotlib", "accelerate"):
        ctx.figure(f"version.{dist}", _version(dist))
    ctx.figure("python", sys.version.split()[0])
    ctx.figure("torch.cuda", torch.version.cuda)
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        ctx.figure("nvidia-smi", q.stdout.strip() or q.stderr.strip())
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        ctx.figure("gpu", {"name": props.name, "capability": f"{props.major}.{props.minor}",
                           "memory_gib": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count})
    floor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    ctx.check("torch at least the pyproject floor", floor >= TORCH_FLOOR, torch.__version__, "2.5")
    errors = {m: e for m in ("cli.main", "specexec", "offload.streaming.pager", "tests.tiny_models")
              if (e := _import(m)) is not None}
    ctx.check("the project imports", not errors, errors or "all", "no error")
    bnb = _import("bitsandbytes")
    ctx.figure("bitsandbytes import", bnb or "ok")
    if ctx.cuda:
        ctx.check("bitsandbytes imports (NF4 on CUDA; carried as a wheel)", bnb is None, bnb or "ok", "imports")
