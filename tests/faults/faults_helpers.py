"""Helpers shared by tests/faults' fault, signal, concurrency and soak tests.

- running `specexec` as a real process, through the phase-hook wrapper (phase_hooks.py) that makes a signal
  land in a chosen phase: exec'd (`command`, for pexpect) or forked from a fork server that imported torch once
  (`fork_cli`: a new Python process spends seconds importing torch, a fork milliseconds);
- looking at a layer cache root: final dirs, temporary dirs of builders, lock files (and whether a lock is free);
- an in-process terminal for `specexec chat` whose input lines can run actions between turns;
- what a fresh session answers (the reference a faulted session's next answer must equal);
- the process's resident memory, open descriptors and live pager threads.
"""
from __future__ import annotations

import atexit
import fcntl
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from offload.cache.identity import cache_dir_for, options_of
from offload.cache.reading import _VERIFIED
from offload.cache.store import LayerCache
from specexec.config import OffloadConfig, SamplingParams
from specexec.checkpoints.loading import read_args
from specexec.checkpoints.naming import layer_names
from tests.cli.screen import Screen

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "160"}
HOOKS = "tests.faults.phase_hooks"


# --------------------------------------------------------------------------------------------- processes

def command(argv: Iterable[str]) -> list[str]:
    """`specexec ARGV` through the hook wrapper (which is plain `specexec` when no hook is armed)."""
    return [sys.executable, "-m", HOOKS, *argv]


class Forked:
    """A `specexec` process forked by the fork server: pid, exit code (-N: killed by signal N), output."""

    def __init__(self, folder: Path) -> None:
        self.dir = folder                     # the fork server may still be importing: pid comes when asked

    @property
    def pid(self) -> int:
        wait_for((self.dir / "pid").exists, 120, "the fork server to start the process")
        return int((self.dir / "pid").read_text())

    def poll(self) -> int | None:
        rc = self.dir / "rc"
        return int(rc.read_text()) if rc.exists() else None

    def wait(self, timeout: float = 120) -> int:
        wait_for(lambda: self.poll() is not None, timeout, f"the process in {self.dir} to exit")
        return self.poll()

    @property
    def out(self) -> str:
        return self._read("stdout")

    @property
    def err(self) -> str:
        return self._read("stderr")

    def _read(self, name: str) -> str:
        path = self.dir / name                # absent when the process writes to a terminal
        return path.read_text() if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL it unless it ended (or never started: the fork server died first)."""
        if self.poll() is None and (self.dir / "pid").exists():
            os.kill(self.pid, signal.SIGKILL)
            self.wait()


_SERVER: list[subprocess.Popen] = []
_SERVER_LOCK = threading.Lock()


def fork_server() -> subprocess.Popen:
    """The fork server (started once per test session; it ends with the session)."""
    with _SERVER_LOCK:
        if not _SERVER or _SERVER[0].poll() is not None:
            proc = subprocess.Popen(command(["--zygote"]), cwd=ROOT, env=ENV, stdin=subprocess.PIPE)
            _SERVER[:] = [proc]
            atexit.register(_stop, proc)
        return _SERVER[0]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def fork_cli(argv: Iterable[str], folder: Path, hook: str | None = None, release: Path | None = None,
             fsize: int | None = None, tty: str | None = None) -> Forked:
    """`specexec ARGV` in a new process forked by the fork server, its output in `folder` (created), with the
    phase hook `hook` armed, the release file of a `hold` hook, RLIMIT_FSIZE `fsize` (bytes), and `tty` (the
    path of a pseudo-terminal's slave) as its terminal (stdin, stdout, stderr) instead of files."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {"RELIABILITY_RELEASE": str(release)} if release is not None else {}
    job = {"argv": list(argv), "dir": str(folder), "env": env, "hook": hook, "fsize": fsize, "tty": tty}
    server = fork_server()
    server.stdin.write(json.dumps(job).encode() + b"\n")
    server.stdin.flush()
    return Forked(folder)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, proc: Forked | None = None) -> None:
    """Poll until predicate() holds; fail naming `what` (and the process's output if it ended) on timeout."""
    end = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited {proc.poll()} before {what}:\n{proc.out}\n{proc.err}")
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# --------------------------------------------------------------------------------------------- cache roots

def cache_dir(model: Path, root: Path, fmt: str = "none", dtype: torch.dtype = torch.float32) -> Path:
    """Where open_or_build puts the cache of `model` under `root` (what convert/--cache-dir use)."""
    model = model.resolve()
    options = options_of(model, layer_names(model, read_args(model)), fmt, dtype, False)
    return cache_dir_for(model, options, root)


def entries(root: Path) -> dict[str, list[str]]:
    """Names under a cache root: finished caches, temporary dirs of builders, lock files."""
    names = sorted(p.name for p in root.iterdir()) if root.exists() else []
    locks = sorted(p.name for p in (root / ".locks").iterdir()) if (root / ".locks").is_dir() else []
    return {"final": [n for n in names if not n.startswith(".")],
            "temp": [n for n in names if n.startswith(".") and n != ".locks"],
            "lock": locks}                          # the build locks live under <root>/.locks, none beside a cache


def lock_is_free(lock: Path) -> bool:
    """Whether nobody holds the flock on `lock` (taken and released again at once)."""
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def layer_digests(cache_path: Path) -> tuple[str, list[str]]:
    """(sha256 of layers.bin, the manifest's per-layer sha256) after a full checksum verification."""
    _VERIFIED.clear()                                   # as a new process would: read every byte
    with LayerCache.open(cache_path, verify=True) as cache:
        return sha256(cache.file), [e["sha256"] for e in cache.manifest["layers"]]


def ssd(cache_root: Path) -> OffloadConfig:
    """Every target layer streamed from the on-disk cache (read from the file on every pass), unquantized."""
    return OffloadConfig.from_flags(offload="ssd", quant="none", cache_dir=str(cache_root))


# --------------------------------------------------------------------------------------------- chat

class ScriptedTerminal(io.TextIOBase):
    """A stdin that says it is a terminal (so `specexec chat` runs its REPL) and feeds `script`: strings are
    typed lines; callables run when the REPL reads past them (between turns), then the next line is read."""

    def __init__(self, script: Iterable[str | Callable[[], None]]) -> None:
        self.script = list(script)

    def isatty(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def readline(self, size: int = -1) -> str:
        while self.script and callable(self.script[0]):
            self.script.pop(0)()
        return self.script.pop(0) + "\n" if self.script else ""       # "" = end of input (Ctrl-D)


def streamed_runtime(pair: tuple[Path, Path], draft: Path, cache_root: Path, budget: int) -> Iterator[object]:
    """A fixture body: the tiny pair with the target on the SSD tier under cache_root; the pager stops after."""
    from specexec.config import EngineConfig
    from specexec.runtime.assembly import Runtime

    runtime = Runtime.load(str(pair[0]), str(draft), EngineConfig(budget=budget, dtype="float32"),
                           offload=ssd(cache_root))
    yield runtime
    runtime.engine.close()


def fresh_answer(runtime, messages: list[dict[str, str]], user: str, max_new: int,
                 sampling: SamplingParams = SamplingParams()) -> str:
    """What a new session holding `messages` answers to `user` (its engine starts from an empty KV cache)."""
    from cli.chat import ChatSession

    runtime.engine.reset()
    screen = Screen()
    session = ChatSession(runtime, sampling, None, screen.console, screen.write, max_new)
    session.messages = [dict(m) for m in messages]
    return session.ask(user).text


# --------------------------------------------------------------------------------------------- process state

def pager_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "layer-pager" and t.is_alive()}


def rss_bytes() -> int:
    try:
        import psutil
        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))
