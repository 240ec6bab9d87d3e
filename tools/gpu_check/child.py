"""One step of the GPU check, in this process: `python -m tools.gpu_check.child NAME RESULT OUT TMP MODE LIMIT`.

Writes RESULT (JSON): status ok | failed | skipped | error, reason, figures, checks. A step fails when one of
its checks fails; an exception is an error (its traceback goes to the step's log).

Does not know: the other steps, the deadline (the driver kills this process when it runs out).
"""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from tools.gpu_check.registry import Context, Skip, all_steps


def main(argv: list[str]) -> int:
    name, result_path, out, tmp, mode, limit = argv
    steps = {s.name: s for s in all_steps()}
    ctx = Context(cuda=mode == "cuda", out=Path(out), tmp=Path(tmp), budget_s=float(limit))
    if not ctx.cuda:
        import torch

        torch.set_num_threads(1)                    # tiny models: threads only contend (as in tests/conftest.py)
    status, reason = "ok", ""
    try:
        steps[name].fn(ctx)
        failed = [c["check"] for c in ctx.checks if not c["ok"]]
        if failed:
            status, reason = "failed", "failed checks: " + ", ".join(failed)
    except Skip as e:
        status, reason = "skipped", str(e)
    except Exception as e:                          # noqa: BLE001 -- the step's error is its result
        traceback.print_exc()
        status, reason = "error", f"{type(e).__name__}: {str(e)[:300]}"
    result = {"status": status, "reason": reason, "figures": ctx.figures, "checks": ctx.checks}
    Path(result_path).write_text(json.dumps(result, default=str))
    print(f"-- {name}: {status}" + (f" ({reason})" if reason else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
