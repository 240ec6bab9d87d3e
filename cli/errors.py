"""Turning an exception into the one line a user sees (`error: ...`) and the exit code.

User mistakes (ConfigError, CheckpointError, CacheError, a file that cannot be read, bad command-line syntax)
exit with 2; anything else is a bug and exits with 1, still in one line unless --debug asks for the traceback.

Does not know: which command ran or what it was doing.
"""
from __future__ import annotations

import sys

from offload.cache import CacheError
from offload.checkpoint import CheckpointError
from specexec.config import ConfigError

USAGE_EXIT = 2
BUG_EXIT = 1
INTERRUPT_EXIT = 130


class UsageError(ConfigError):
    """Bad command-line syntax (what argparse would report with a usage banner)."""


def one_line(text: str) -> str:
    """Collapse a message to one line."""
    return " ".join(str(text).split())


def describe(exc: BaseException) -> tuple[str, int]:
    """(message, exit code) for an exception that ends a command."""
    if isinstance(exc, (ConfigError, CheckpointError, CacheError)):
        return one_line(exc), USAGE_EXIT
    if isinstance(exc, OSError) and exc.filename is not None:
        reason = exc.strerror or type(exc).__name__
        return one_line(f"{exc.filename}: {reason}"), USAGE_EXIT
    return one_line(f"internal error {type(exc).__name__}: {exc} (rerun with --debug for the traceback)"), BUG_EXIT


def report(exc: BaseException) -> int:
    """Print `error: <one line>` to stderr and return the exit code."""
    message, code = describe(exc)
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code
