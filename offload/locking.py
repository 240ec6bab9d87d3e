"""An exclusive, crash-safe lock between processes: flock on a lock file.

The kernel drops a flock when its holder exits, so a lock file left by a dead process never blocks anyone; the
file's content is only the holder's pid, shown in the waiting message.

Does not know: what the lock protects (offload/cache.py holds it while building a layer cache).
"""
from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


class LockTimeout(Exception):
    """Waited longer than the caller allowed; the message names the lock file."""


@contextmanager
def exclusive_lock(lock_path: Path, timeout: float | None = None, log: Callable[[str], None] | None = None,
                   error: type[Exception] = LockTimeout) -> Iterator[None]:
    """Hold an exclusive flock on lock_path; wait (polling, interruptible) while another process holds it.
    log(msg) hears once who is being waited for; `error` is raised (one line) after `timeout` seconds."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, lock_path, timeout, log, error)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)                                   # closing the descriptor releases the lock


def _acquire(fd: int, lock_path: Path, timeout: float | None, log: Callable[[str], None] | None,
             error: type[Exception]) -> None:
    start, told = time.monotonic(), False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if not told and log is not None:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            log(f"waiting for process {holder}, which is building {lock_path.with_suffix('')}")
            told = True
        if timeout is not None and time.monotonic() - start > timeout:
            raise error(f"timed out after {timeout:g} s waiting for the lock {lock_path}")
        time.sleep(0.05)
