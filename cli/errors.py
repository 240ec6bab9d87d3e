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

import argparse
import errno
import io
import os
import select
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

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


# A user's mistake about a checkpoint or the layer cache: (module, class). Looked up only where the module is
# already imported (an exception of a class never loaded cannot have been raised), so reporting a usage error
# imports neither module (both import torch).
USER_ERRORS = (("offload.formats.checkpoint", "CheckpointError"), ("offload.cache.manifest", "CacheError"))


def user_error_types() -> tuple[type, ...]:
    """ConfigError and those of USER_ERRORS whose module is loaded."""
    return (ConfigError, *(getattr(sys.modules[m], name) for m, name in USER_ERRORS if m in sys.modules))


def describe(exc: BaseException) -> tuple[str, int]:
    """(message, exit code) for an exception that ends a command."""
    mistakes = user_error_types()
    if isinstance(exc, mistakes):
        return one_line(exc), USAGE_EXIT
    if isinstance(exc, RuntimeError) and isinstance(exc.__cause__, mistakes):
        return one_line(exc), USAGE_EXIT           # wrapped with context, e.g. "loading layer 3 failed: ..."
    if isinstance(exc, OSError) and exc.filename is not None:
        reason = exc.strerror or type(exc).__name__
        return one_line(f"{exc.filename}: {reason}"), USAGE_EXIT
    return one_line(f"internal error {type(exc).__name__}: {exc} (rerun with --debug for the traceback)"), BUG_EXIT


def as_typed(exc: BaseException, parser: argparse.ArgumentParser | None, args: argparse.Namespace | None
             ) -> BaseException:
    """A ConfigError about a setting the user gave as a flag, named by that flag (`max_new_tokens must be ...`
    -> `--max-new-tokens must be ...`): only when the command has the flag and the refused value is the one
    the flag parsed to (a config.json field of the same name keeps its own name)."""
    subject = getattr(exc, "subject", None)
    if not isinstance(exc, ConfigError) or not subject or subject.startswith("-") or parser is None:
        return exc
    dest = subject.replace("-", "_")
    for action in parser._actions:
        given = getattr(args, dest, None)
        if action.dest == dest and action.option_strings and given is not None and str(given) == str(exc.value):
            return exc.named(max(action.option_strings, key=len))
    return exc


def report(exc: BaseException) -> int:
    """Print `error: <one line>` to stderr (unless stderr is closed too) and return the exit code."""
    message, code = describe(exc)
    try:
        print(f"error: {message}", file=sys.stderr, flush=True)
    except OSError:
        pass
    return code


def _stdout_has_no_reader() -> bool:
    """Whether standard output is a pipe whose reading end is closed (poll says POLLERR); True where poll is
    missing (Windows), so an EPIPE there counts as stdout's."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return False
    poll = getattr(select, "poll", None)
    if poll is None:
        return True
    watch = poll()
    watch.register(fd, select.POLLOUT)
    return any(event & (select.POLLERR | select.POLLHUP) for _, event in watch.poll(0))


def _broken_pipe(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno == errno.EPIPE:     # stdout's, not a socket's (bench --endpoint)
        return _stdout_has_no_reader()
    if isinstance(exc, SystemExit):                   # rich's Console.on_broken_pipe: quiet, then SystemExit(1)
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        return tb is not None and tb.tb_frame.f_code.co_name == "on_broken_pipe"
    return False


def closed_stdout(exc: BaseException) -> bool:
    """Whether `exc` says the reader of standard output went away (EPIPE: `specexec models | head -3`), itself
    or as the cause of what wrapped it. When it does, standard output is pointed at the null device, so the
    rest of what the command (or Python at exit) writes goes nowhere instead of failing again."""
    seen: BaseException | None = exc
    while seen is not None and not _broken_pipe(seen):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return False
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, io.UnsupportedOperation):    # no real file behind sys.stdout (a test's capture)
        pass
    return True


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
