"""Compiling the C sources (csrc/*.c) on first use and loading the library with ctypes; saying once, in one line, why
not when it cannot.

The library is built with the machine's C compiler ($CC, else cc, gcc or clang) for this very CPU (-march=native)
with OpenMP, into `<cache root>/kernels/` ($SPECEXEC_CACHE, like the layer cache; readable by this user alone),
named after a hash of the source, the compiler's version, the flags and the CPU's feature flags: a copy made on
another machine or from another source is never loaded. Beside each library, the sha256 of the bytes the build
wrote: a library that does not match it (truncated, overwritten, planted) is rebuilt before it is opened, and one
the loader refuses (a missing symbol) leaves the pure-torch path with one line. Two processes building at once each write their own temporary file and rename it
into place (the same bytes either way). $SPECEXEC_CPU_KERNELS=0 turns the library off (the pure-torch path runs).

Does not know: what the kernels compute (csrc/, ops.py), the functions' signatures (abi.py), tensors, formats.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cpu_kernels import abi
from cpu_kernels.cache_root import default_cache_root

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(sorted(CSRC.glob("*.c")))          # compiled together into one library
HEADERS = tuple(sorted(CSRC.glob("*.h")))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-ffp-contract=off")
ENV_SWITCH = "SPECEXEC_CPU_KERNELS"


def compiler() -> str | None:
    """The C compiler to use: $CC, else the first of cc, gcc, clang on PATH; None when there is none."""
    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux: /proc/cpuinfo), else the machine's name: part of the library's key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _key(cc: str) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    h = hashlib.sha256()
    sources = [p.read_bytes() for p in (*SOURCES, *HEADERS)]
    for part in (*sources, version.encode(), " ".join(FLAGS).encode(), _cpu_flags().encode()):
        h.update(part)
    return h.hexdigest()[:16]


def _kernel_dir() -> Path:
    """<cache root>/kernels, made (and kept, when it is ours) readable and writable by this user alone: a library
    there is loaded into the process, so no one else may put one there."""
    path = default_cache_root() / "kernels"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if hasattr(os, "getuid") and path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trusted(path: Path) -> bool:
    """Whether `path` holds the bytes this machine's build wrote (its sha256 sidecar, written at build time):
    a truncated, overwritten or planted library is never opened (a truncated one crashes dlopen with SIGBUS)."""
    sidecar = path.with_name(path.name + ".sha256")
    try:
        return path.is_file() and sidecar.read_text().strip() == _digest(path)
    except OSError:
        return False


def _compile(cc: str, target: Path) -> None:
    """cc FLAGS csrc/*.c -o target, through a temporary file renamed into place; RuntimeError with the
    compiler's last lines when it fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise RuntimeError(f"{Path(cc).name} failed on csrc/*.c: {tail}")
        sidecar = target.with_name(target.name + ".sha256")
        sidecar_tmp = Path(tmp + ".sha256")
        sidecar_tmp.write_text(_digest(Path(tmp)) + "\n")
        os.replace(sidecar_tmp, sidecar)               # the digest first: a library without one is rebuilt
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load(path: Path) -> ctypes.CDLL:
    """The library at `path` with every function's ctypes signature set and its structs' layout checked against
    the mirrors (abi.check: RuntimeError when they differ)."""
    lib = ctypes.CDLL(str(path))
    abi.check(lib)
    return lib


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library or None, one line saying which kernels run and why)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, f"CPU kernels off (${ENV_SWITCH}=0): int4/int8 linears run the pure-torch path"
    import torch                                   # its libgomp must be loaded first: the kernels share its pool
    del torch
    cc = compiler()
    if cc is None:
        return None, ("no C compiler (cc, gcc or clang; or $CC) found: int4/int8 CPU linears run the slower "
                      "pure-torch path; install gcc for the integer kernels")
    try:
        path = _kernel_dir() / f"cpu-kernels-{_key(cc)}.so"
        if not _trusted(path):                     # absent, or not the bytes a build here wrote: build it anew
            _compile(cc, path)
        lib = load(path)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:   # AttributeError: a symbol
        return None, f"CPU kernels unavailable ({e}): int4/int8 CPU linears run the slower pure-torch path"
    return lib, f"CPU kernels: {lib.sx_isa().decode()} ({path})"


def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None (and the reason printed once to stderr) when they cannot
    be had, in which case callers run the pure-torch path."""
    lib, why = _library()
    if lib is None and os.environ.get(ENV_SWITCH, "1") != "0":
        _warn_once(why)
    return lib


def status() -> str:
    """One line: which CPU kernels run here (ISA and library path), or why none do."""
    return _library()[1]


@functools.cache
def _warn_once(why: str) -> None:
    print(f"specexec: {why}", file=sys.stderr)
