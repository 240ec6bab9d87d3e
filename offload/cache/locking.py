"""An exclusive, crash-safe lock between processes (and threads) on a lock file.

The mechanism is the platform's, in this order:
- flock on the lock file (POSIX): the kernel drops it when its holder exits, so a lock left by a dead process
  never blocks anyone;
- msvcrt.locking of one byte of the lock file (Windows): Windows drops it when its holder exits;
- a lock directory "<lock file>.d" made with os.mkdir (atomic everywhere) holding an `owner` file (pid, host,
  random token), where neither exists or the file system refuses flock (ENOLCK, EOPNOTSUPP: some network
  and FUSE file systems). A directory outlives a killed holder, so a waiter checks the owner: one whose pid is
  gone on this host is dead, and its directory is removed (under a "<lock file>.d.break" directory, so two
  waiters never both break it and none removes a lock a live process took meanwhile) before taking the lock.
  An owner on another host cannot be checked and is waited for.
In every case the lock file's content is the holder's pid, shown in the waiting message.

Does not know: what the lock protects (offload/cache/store.py holds it while building a layer cache).
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from offload.platform.facilities import optional_module, pid_alive, pread_into, pwrite_all

POLL = 0.05                   # seconds between attempts while another process holds the lock
ORPHAN_S = 10.0               # a lock directory without an owner file this old: its maker died making it
MSVCRT_BYTE = 1 << 20         # the byte msvcrt locks: past the pid, which waiters must still be able to read
UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class LockTimeout(Exception):
    """Waited longer than the caller allowed; the message names the lock file."""


@contextmanager
def exclusive_lock(lock_path: Path, timeout: float | None = None, log: Callable[[str], None] | None = None,
                   error: type[Exception] = LockTimeout) -> Iterator[None]:
    """Hold an exclusive lock on lock_path; wait (polling, interruptible) while another process holds it.
    log(msg) hears once who is being waited for; `error` is raised (one line) after `timeout` seconds."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_BINARY", 0), 0o644)
    try:
        lock = _acquire(fd, lock_path, timeout, log, error)
        try:
            os.ftruncate(fd, 0)
            pwrite_all(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            lock.release()
    finally:
        os.close(fd)                                   # (flock, msvcrt: closing would release it as well)


def _acquire(fd: int, lock_path: Path, timeout: float | None, log: Callable[[str], None] | None,
             error: type[Exception]) -> "_Flock | _Msvcrt | _LockDir":
    lock = _mechanism(fd, lock_path)
    start, told = time.monotonic(), False
    while True:
        try:
            if lock.take():
                return lock
        except _Unsupported:
            lock = _LockDir(lock_path)
            continue
        if not told and log is not None:
            log(f"waiting for process {lock.holder()}, which is building {lock_path.with_suffix('')}")
            told = True
        if timeout is not None and time.monotonic() - start > timeout:
            raise error(f"timed out after {timeout:g} s waiting for the lock {lock_path}")
        time.sleep(POLL)


def _mechanism(fd: int, lock_path: Path) -> "_Flock | _Msvcrt | _LockDir":
    fcntl = optional_module("fcntl")
    if fcntl is not None and hasattr(fcntl, "flock"):
        return _Flock(fd, fcntl)
    msvcrt = optional_module("msvcrt")
    if msvcrt is not None and hasattr(msvcrt, "locking"):
        return _Msvcrt(fd, msvcrt)
    return _LockDir(lock_path)


class _Unsupported(Exception):
    """The file system refuses this mechanism (the next one is used)."""


def _pid_in(fd: int) -> str:
    buf = bytearray(32)
    n = pread_into(fd, memoryview(buf), 0)
    return buf[:n].decode(errors="replace").strip() or "?"


class _Flock:
    def __init__(self, fd: int, fcntl) -> None:
        self.fd, self.fcntl = fd, fcntl

    def take(self) -> bool:
        try:
            self.fcntl.flock(self.fd, self.fcntl.LOCK_EX | self.fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno in UNSUPPORTED:
                raise _Unsupported from e
            raise

    def holder(self) -> str:
        return _pid_in(self.fd)

    def release(self) -> None:
        self.fcntl.flock(self.fd, self.fcntl.LOCK_UN)


class _Msvcrt:
    """msvcrt.locking locks bytes from the current position; Windows byte-range locks are mandatory, so the
    locked byte lies past the pid that waiters read."""

    def __init__(self, fd: int, msvcrt) -> None:
        self.fd, self.msvcrt = fd, msvcrt

    def _lock(self, mode: int) -> None:
        os.lseek(self.fd, MSVCRT_BYTE, os.SEEK_SET)
        self.msvcrt.locking(self.fd, mode, 1)

    def take(self) -> bool:
        try:
            self._lock(self.msvcrt.LK_NBLCK)
            return True
        except PermissionError:              # EACCES / EDEADLOCK: held by another handle
            return False
        except OSError as e:
            if e.errno == errno.EDEADLOCK:
                return False
            if e.errno in UNSUPPORTED:
                raise _Unsupported from e
            raise

    def holder(self) -> str:
        return _pid_in(self.fd)

    def release(self) -> None:
        self._lock(self.msvcrt.LK_UNLCK)


class _LockDir:
    OWNER = "owner"

    def __init__(self, lock_path: Path) -> None:
        self.dir = lock_path.with_name(lock_path.name + ".d")
        self.breaker = lock_path.with_name(lock_path.name + ".d.break")
        self.token = secrets.token_hex(8)
        self.me = f"{os.getpid()} {socket.gethostname()} {self.token}"

    def take(self) -> bool:
        for _ in range(2):                   # a second try right after breaking a dead owner's lock
            try:
                os.mkdir(self.dir)
                break
            except FileExistsError:
                if not self._break_if_dead():
                    return False
        else:
            return False
        tmp = self.dir / f".{self.OWNER}.{self.token}"
        tmp.write_text(self.me + "\n")
        os.replace(tmp, self.dir / self.OWNER)
        return True

    def _owner(self) -> str | None:
        try:
            return (self.dir / self.OWNER).read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def holder(self) -> str:
        owner = self._owner()
        return owner.split()[0] if owner else "?"

    def _dead(self, owner: str | None) -> bool:
        if owner is None:                    # made, owner not written yet: dead only if that was long ago
            try:
                return time.time() - self.dir.stat().st_mtime > ORPHAN_S
            except FileNotFoundError:
                return False
        pid, host = (owner.split() + ["", ""])[:2]
        if host != socket.gethostname() or not pid.isdigit():
            return False                     # another machine's process: cannot tell, wait
        return int(pid) != os.getpid() and not pid_alive(int(pid))

    def _break_if_dead(self) -> bool:
        """Remove the lock directory if its owner is dead; True when it was removed."""
        owner = self._owner()
        if not self._dead(owner):
            return False
        try:
            os.mkdir(self.breaker)
        except FileExistsError:
            with contextlib.suppress(OSError):       # a breaker that died breaking (it takes milliseconds)
                if time.time() - self.breaker.stat().st_mtime > ORPHAN_S:
                    os.rmdir(self.breaker)
            return False
        try:
            if self._owner() != owner or not self._dead(owner):
                return False                 # taken by a live process since we looked
            shutil.rmtree(self.dir)
            return True
        except FileNotFoundError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(self.breaker)

    def release(self) -> None:
        if self._owner() == self.me:         # else a waiter judged us dead (only across pid namespaces)
            os.remove(self.dir / self.OWNER)
            os.rmdir(self.dir)
