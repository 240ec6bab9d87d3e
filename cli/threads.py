"""`--threads N` on every command: the CPU threads torch's operators and the compiled kernels use.

Without it (and without $OMP_NUM_THREADS, which counts as given) a run takes the physical cores, fewer on an
oversubscribed machine (cpu_kernels/threads.choose). Set after parsing, for the command's run (`applied`): with
torch.set_num_threads when torch is already imported, else through $OMP_NUM_THREADS, which torch reads when it
starts (so a command that never imports torch does not pay for it). `note()` is what the load line says.

Does not know: what the command computes.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from cpu_kernels.threads import Threads, choose
from specexec.options import check_integer

HELP = ("CPU threads for torch and the compiled kernels (default: the physical cores, fewer while other programs "
        "oversubscribe them; $OMP_NUM_THREADS counts as given)")
_chosen: list[Threads] = []                        # the choice of this process's command, for the load line


def add_flag(p: argparse.ArgumentParser) -> None:
    """--threads on `p`, unless it has its own (the component benchmarks)."""
    if "--threads" not in p._option_string_actions:
        p.add_argument("--threads", type=int, metavar="N", help=HELP)


@contextmanager
def applied(args: argparse.Namespace) -> Iterator[Threads]:
    """Choose the threads (args.threads, else $OMP_NUM_THREADS, else the default) and set them for the command;
    restored after it (an in-process caller, a test, keeps its own)."""
    given = getattr(args, "threads", None)
    env = os.environ.get("OMP_NUM_THREADS")
    if given is None and (env or "").strip().isdigit() and int(env) >= 1:
        given = int(env)
    if given is not None:
        check_integer("--threads", given, low=1, high=1024)
    threads = choose(given)
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(threads.count)
    else:
        os.environ["OMP_NUM_THREADS"] = str(threads.count)
    _chosen[:] = [threads]
    try:
        yield threads
    finally:
        _chosen.clear()
        if before is not None:
            torch.set_num_threads(before)
        elif env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env


def current() -> Threads | None:
    """This command's choice (None before apply: a caller that is not the command line)."""
    return _chosen[0] if _chosen else None


def note(device: str = "cpu") -> str:
    """' · N threads' for the load line of a run on `device` (on a GPU only an oversubscription is said);
    '' before apply."""
    if not _chosen or (device != "cpu" and not _chosen[0].busy):
        return ""
    return f" · {_chosen[0].note()}"


