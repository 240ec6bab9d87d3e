"""The operating-system facilities the SSD tier, the layer cache and its lock rely on, and what stands in for each
where a platform lacks one (Windows, macOS, some file systems). One place that says which exist.

  facility                     where it exists                     stand-in elsewhere
  positional reads             os.preadv (Linux, BSD, macOS 11+)   os.pread + a copy (older macOS); else lseek +
                                                                   readinto under one lock (Windows)
  positional writes            os.pwrite (POSIX)                   lseek + write under the same lock (Windows)
  reads that skip the page     O_DIRECT (Linux, BSD);              buffered reads (then dropped from the page
  cache                        F_NOCACHE (macOS)                   cache where posix_fadvise exists)
  dropping pages just read     posix_fadvise(DONTNEED)             nothing: the OS reclaims its cache by itself
  durable renames              fsync of the directory (POSIX)      nothing (Windows cannot open a directory;
                                                                   NTFS journals its metadata)
  raw descriptors              O_BINARY (Windows: else text mode   not needed elsewhere
                               would translate newlines)
  is a process alive           kill(pid, 0) (POSIX)                OpenProcess + GetExitCodeProcess (Windows)

Every function looks its facility up when called, never at import, so a test can take one away with
monkeypatch and run the very path a machine without it runs (tests/conftest.py `posix_facilities`).

Does not know: layers, caches, what the bytes mean; locks (locking.py picks its own mechanism).
"""
from __future__ import annotations

import importlib
import io
import os
import threading
from types import ModuleType

_SEEK_LOCK = threading.Lock()      # lseek + read/write share a descriptor's offset: one at a time


def optional_module(name: str) -> ModuleType | None:
    """The module `name` (e.g. fcntl, msvcrt), or None where this platform has none."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def open_read(path: str | os.PathLike) -> int:
    """A read-only descriptor for raw bytes (O_BINARY on Windows)."""
    return os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))


def open_unbuffered(path: str | os.PathLike) -> int | None:
    """A read-only descriptor whose reads skip the page cache (O_DIRECT; on macOS F_NOCACHE), or None where the
    platform has neither, the file system refuses (tmpfs, some FUSE and network file systems), or the file
    cannot be opened (the caller's plain open then says why)."""
    direct = getattr(os, "O_DIRECT", None)
    if direct is not None:
        try:
            return os.open(path, os.O_RDONLY | direct)
        except OSError:
            return None
    fcntl = optional_module("fcntl")
    if fcntl is None or not hasattr(fcntl, "F_NOCACHE"):
        return None
    try:
        fd = open_read(path)
    except OSError:
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_NOCACHE, 1)
    except OSError:
        os.close(fd)
        return None
    return fd


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read up to len(view) bytes of fd at `offset` into `view`; the count (0 at end of file). Safe from several
    threads on one descriptor (the lseek stand-in holds a lock)."""
    preadv = getattr(os, "preadv", None)
    if preadv is not None:
        return preadv(fd, [view], offset)
    pread = getattr(os, "pread", None)
    if pread is not None:
        data = pread(fd, len(view), offset)
        view[:len(data)] = data
        return len(data)
    with _SEEK_LOCK:
        os.lseek(fd, offset, os.SEEK_SET)
        return io.FileIO(fd, "r", closefd=False).readinto(view) or 0


def pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    """Write all of `data` to fd at `offset` (looping over short writes)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        pwrite = getattr(os, "pwrite", None)
        if pwrite is not None:
            done += pwrite(fd, view[done:], offset + done)
            continue
        with _SEEK_LOCK:
            os.lseek(fd, offset + done, os.SEEK_SET)
            done += os.write(fd, view[done:])


def drop_cached(fd: int, offset: int, nbytes: int) -> None:
    """Tell the kernel the pages of fd[offset:offset+nbytes] are not needed again (where posix_fadvise exists)."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is not None:
        fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def advise_sequential(fd: int) -> None:
    """Tell the kernel fd is read front to back (where posix_fadvise exists)."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is not None:
        fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename into directory `path` durable: fsync the directory where directories can be opened
    (POSIX: O_DIRECTORY exists); nothing elsewhere."""
    flag = getattr(os, "O_DIRECTORY", None)
    if flag is None:
        return
    fd = os.open(path, os.O_RDONLY | flag)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` (on this machine) still runs. Unsure counts as alive."""
    if os.name == "nt":
        return _windows_pid_alive(pid)
    try:
        os.kill(pid, 0)                      # signal 0: only checks (on Windows it would send Ctrl-C: not used)
    except ProcessLookupError:
        return False
    except OSError:                          # EPERM: it exists, owned by someone else
        return True
    return True


def _windows_pid_alive(pid: int) -> bool:
    import ctypes

    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
    kernel32.OpenProcess.restype = ctypes.c_void_p
    kernel32.OpenProcess.argtypes = (ctypes.c_uint32, ctypes.c_int, ctypes.c_uint32)
    kernel32.GetExitCodeProcess.argtypes = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32))
    kernel32.CloseHandle.argtypes = (ctypes.c_void_p,)
    handle = kernel32.OpenProcess(0x1000, False, pid)          # PROCESS_QUERY_LIMITED_INFORMATION
    if not handle:
        return ctypes.get_last_error() == 5                    # ERROR_ACCESS_DENIED: exists, someone else's
    try:
        code = ctypes.c_uint32()
        if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
            return True
        return code.value == 259                               # STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)


def missing() -> list[str]:
    """The facilities of the table above this process lacks (for messages and `specexec doctor`)."""
    checks = {"os.preadv": hasattr(os, "preadv"), "os.pwrite": hasattr(os, "pwrite"),
              "O_DIRECT": hasattr(os, "O_DIRECT") or hasattr(optional_module("fcntl"), "F_NOCACHE"),
              "posix_fadvise": hasattr(os, "posix_fadvise"), "directory fsync": hasattr(os, "O_DIRECTORY"),
              "flock": hasattr(optional_module("fcntl"), "flock")}
    return [name for name, present in checks.items() if not present]

