"""Turning an exception into the one line a user sees (`error: ...`) and the exit code.

User mistakes (ConfigError, CheckpointError, CacheError, a file that cannot be read, bad command-line syntax)
exit with 2, also when they reach the command wrapped (e.g. the pager's "loading layer i failed: <CacheError>"
from its reader thread); anything else is a bug and exits with 1, still in one line unless --debug asks for the
traceback. SIGTERM (`sigterm_raises`, where the platform has it) becomes a `Terminated` exception in the main
thread, so cleanups run (a half-written layer cache is removed, the pager thread stops); the command then exits
with 143. (On Windows, which ends a process without a signal, the cleanups that matter happen at the next start:
a builder's leftovers are removed, its lock is free.)

Does not know: which command ran or what it was doing.
"""
from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from offload.cache.manifest import CacheError
from offload.formats.checkpoint import CheckpointError
from specexec.options import ConfigError

USAGE_EXIT = 2
BUG_EXIT = 1
INTERRUPT_EXIT = 130
TERMINATED_EXIT = 143          # 128 + SIGTERM, what a shell reports for a process SIGTERM killed


class UsageError(ConfigError):
    """Bad command-line syntax (what argparse would report with a usage banner)."""


def one_line(text: str) -> str:
    """Collapse a message to one line; any other control character (an ANSI escape inside a library's message,
    an ESC in a user-supplied path) is shown escaped, never sent raw to the terminal."""
    flat = " ".join(str(text).split())
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in flat)


def describe(exc: BaseException) -> tuple[str, int]:
    """(message, exit code) for an exception that ends a command."""
    if isinstance(exc, (ConfigError, CheckpointError, CacheError)):
        return one_line(exc), USAGE_EXIT
    if isinstance(exc, RuntimeError) and isinstance(exc.__cause__, (ConfigError, CheckpointError, CacheError)):
        return one_line(exc), USAGE_EXIT           # wrapped with context, e.g. "loading layer 3 failed: ..."
    if isinstance(exc, OSError) and exc.filename is not None:
        reason = exc.strerror or type(exc).__name__
        return one_line(f"{exc.filename}: {reason}"), USAGE_EXIT
    return one_line(f"internal error {type(exc).__name__}: {exc} (rerun with --debug for the traceback)"), BUG_EXIT


def report(exc: BaseException) -> int:
    """Print `error: <one line>` to stderr and return the exit code."""
    message, code = describe(exc)
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


class Terminated(BaseException):
    """SIGTERM arrived (see sigterm_raises). A BaseException, so `except Exception` and the chat's Ctrl-C
    handling do not swallow it."""


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside: SIGTERM raises Terminated in the main thread (elsewhere, e.g. a command run in a thread, or
    on a platform without SIGTERM, nothing changes; Ctrl-C is KeyboardInterrupt everywhere, as always); the
    previous handler comes back on exit."""
    sigterm = getattr(signal, "SIGTERM", None)
    if sigterm is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        raise Terminated(f"signal {signum}")

    previous = signal.signal(sigterm, handler)
    try:
        yield
    finally:
        signal.signal(sigterm, signal.SIG_DFL if previous is None else previous)
