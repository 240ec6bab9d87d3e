"""Test-only wrapper around `specexec`: `python -m tests.faults.phase_hooks <specexec args>` runs
cli.main.main after patching a few functions so a signal (or a pause) lands in a chosen phase, deterministically.
No hook lives in product code.

A hook is `PHASE@N:ACTION`:
  PHASE   prefill | draft | verify   (Engine.prefill, a tree builder's build, Engine._verify): fires at the
                                     2nd decoder-Block forward inside the N-th such call, i.e. mid-pass (for an
                                     offloaded target: while the pager streams layers)
          write                      (offload.cache.store._write_layer): fires before the N-th layer is written
  ACTION  INT | TERM | KILL          the signal sent to this very process
          hold                       wait until the file $RELIABILITY_RELEASE exists (lock held, temp dir made)
Armed from $RELIABILITY_HOOK at start, and, for `chat`, by a message that starts with `!hook SPEC ` (the message
is sent as typed; phases are counted from that message on).

`python -m tests.faults.phase_hooks --zygote` is a fork server: it imports everything once (a new Python
process spends seconds importing torch), then forks one real `specexec` process per JSON line read on stdin
({"argv", "dir", "env", "hook", "fsize", "tty"}): the child's stdout/stderr go to files in "dir" (or, with "tty",
the path of a pseudo-terminal's slave, all three standard streams go there and it becomes the child's
controlling terminal), "fsize" caps the size of any file it writes (RLIMIT_FSIZE), and the fork server writes
"pid" there at once and "rc" (the exit code, -N for death by signal N, as subprocess reports it) when the child
ends.
"""
from __future__ import annotations

import json
import os
import resource
import select
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

ARMED: dict = {}          # phase, occurrence, action, plus counters: seen (phase calls), blocks (in the target one)
CURRENT: list[str] = []   # the phase stack of the running call


def arm(spec: str) -> None:
    where, action = spec.split(":", 1)
    phase, n = where.split("@")
    ARMED.clear()
    ARMED.update(phase=phase, n=int(n), action=action, seen=0, blocks=0, active=False)


def fire() -> None:
    action = ARMED.pop("action")
    ARMED.clear()
    if action == "hold":
        release = os.environ["RELIABILITY_RELEASE"]
        while not os.path.exists(release):
            time.sleep(0.05)
        return
    os.kill(os.getpid(), getattr(signal, f"SIG{action}"))
    time.sleep(30)                       # the handler raises here (INT, TERM); KILL never returns


@contextmanager
def phase(name: str):
    outer = name in CURRENT              # a builder's build calling its parent class's build: one occurrence
    if not outer and ARMED.get("phase") == name:
        ARMED["seen"] += 1
        ARMED["active"] = ARMED["seen"] == ARMED["n"]
    CURRENT.append(name)
    try:
        yield
    finally:
        CURRENT.pop()
        if not outer and ARMED.get("phase") == name:
            ARMED["active"] = False


def wrap_phase(owner: type, attr: str, name: str) -> None:
    real = owner.__dict__[attr]

    def wrapped(*args, **kwargs):
        with phase(name):
            return real(*args, **kwargs)

    setattr(owner, attr, wrapped)


def install() -> None:
    from cli import chat
    from offload.cache import store as cache
    from specexec.network import model
    from specexec.builders import registry
    from specexec.decoding.engine import Engine

    wrap_phase(Engine, "prefill", "prefill")
    wrap_phase(Engine, "_verify", "verify")
    owners = {k for c in registry.factories().values() if isinstance(c, type) for k in c.__mro__
              if "build" in k.__dict__ and k.__module__.startswith("specexec")}
    for klass in owners:
        wrap_phase(klass, "build", "draft")

    block_forward = model.Block.forward

    def forward(self, *args, **kwargs):
        if ARMED.get("active") and CURRENT and CURRENT[-1] == ARMED["phase"]:
            ARMED["blocks"] += 1
            if ARMED["blocks"] == 2:
                fire()
        return block_forward(self, *args, **kwargs)

    model.Block.forward = forward

    write_layer = cache._write_layer

    def write(fd, buf, offset):
        if ARMED.get("phase") == "write":
            ARMED["seen"] += 1
            if ARMED["seen"] == ARMED["n"]:
                fire()
        return write_layer(fd, buf, offset)

    cache._write_layer = write

    fit = chat.ChatSession.fit

    def fit_armed(self, user: str):
        if user.startswith("!hook "):
            arm(user.split()[1])
        return fit(self, user)

    chat.ChatSession.fit = fit_armed


def _publish(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _child(job: dict, main) -> None:
    """In the forked child: set up the job's environment, limits, hook and files; run main; exit."""
    try:
        os.environ.update(job.get("env", {}))
        if job.get("fsize"):
            resource.setrlimit(resource.RLIMIT_FSIZE, (job["fsize"], resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        out = Path(job["dir"])
        if job.get("tty"):
            os.setsid()
            tty = os.open(job["tty"], os.O_RDWR)            # the first terminal a session leader opens: its own
            for fd in (0, 1, 2):
                os.dup2(tty, fd)
        else:
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        ARMED.clear()
        if job.get("hook"):
            arm(job["hook"])
        code = main(job["argv"])
    except BaseException:                       # noqa: BLE001 -- shown in the child's stderr, exit 1
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def zygote() -> None:
    """The fork server (see the module docstring); ends at end of input."""
    import threading

    install()
    from cli.main import main
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401 -- imported once, here

    children: dict[int, Path] = {}
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        if ready:
            data = os.read(0, 65536)
            if not data:
                break
            pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            job = json.loads(line)
            assert threading.active_count() == 1, "forking a process with threads"
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(job, main)
            children[pid] = Path(job["dir"])
            _publish(children[pid] / "pid", str(pid))
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _publish(children.pop(pid) / "rc", str(os.waitstatus_to_exitcode(status)))


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    zygote()
elif __name__ == "__main__":
    install()
    if os.environ.get("RELIABILITY_HOOK"):
        arm(os.environ["RELIABILITY_HOOK"])
    from cli.main import main

    sys.exit(main(sys.argv[1:]))
