"""The compiled kernel library is opened only when it holds the bytes this machine's build wrote (the sha256
beside it): a truncated one (which crashed dlopen with SIGBUS) or a planted one is rebuilt first; a library the
loader refuses (a missing symbol) leaves the pure-torch path with one line, not an internal error; its directory
is this user's alone."""
from __future__ import annotations

import re
import shutil
import stat
from pathlib import Path

import pytest

from cpu_kernels import build


@pytest.fixture
def real_library() -> Path:
    line = build.status()
    found = re.search(r"\((/[^)]+\.so)\)$", line)
    if found is None:
        pytest.skip(f"no compiled kernels here: {line}")
    return Path(found.group(1))


@pytest.fixture
def fresh(real_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A cache root of its own and a _library() that has not run yet in this process (after the real library was
    found where it is)."""
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path))
    build._library.cache_clear()
    yield tmp_path
    build._library.cache_clear()


def _compile_by_copy(real: Path, calls: list):
    def compile_(cc: str, target: Path) -> None:        # the compiler's work, without the compiler's minutes
        calls.append(target)
        shutil.copyfile(real, target)
        target.with_name(target.name + ".sha256").write_text(build._digest(target))
    return compile_


def test_a_truncated_library_is_rebuilt_before_it_is_opened(fresh, real_library, monkeypatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(build, "_compile", _compile_by_copy(real_library, calls))
    assert build._library()[0] is not None and len(calls) == 1          # built once, with its digest
    target = calls[0]
    build._library.cache_clear()
    assert build._library()[0] is not None and len(calls) == 1          # trusted: opened as it is
    cut = target.with_suffix(".cut")                                     # truncated on disk (a new file: this
    cut.write_bytes(target.read_bytes()[:4096])                          # process has the old one mapped)
    cut.replace(target)
    build._library.cache_clear()
    lib, line = build._library()
    assert lib is not None and len(calls) == 2 and "CPU kernels:" in line
    assert build._trusted(target)


def test_a_library_without_the_builds_digest_is_never_opened(fresh, real_library, monkeypatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(build, "_compile", _compile_by_copy(real_library, calls))
    opened: list[str] = []
    monkeypatch.setattr(build.ctypes, "CDLL", lambda path: opened.append(path) or (_ for _ in ()).throw(OSError))
    planted = build._kernel_dir() / f"cpu-kernels-{build._key(build.compiler())}.so"
    planted.write_bytes(b"\x7fELF planted")
    build._library()
    assert calls == [planted] and opened == [str(planted)] and planted.read_bytes() == real_library.read_bytes()


def test_a_missing_symbol_is_the_fallback_line(fresh, real_library, monkeypatch) -> None:
    monkeypatch.setattr(build, "_compile", _compile_by_copy(real_library, []))

    def check(lib) -> None:
        raise AttributeError("undefined symbol: sx_q4_linear")
    monkeypatch.setattr(build.abi, "check", check)
    lib, line = build._library()
    assert lib is None and line.startswith("CPU kernels unavailable (undefined symbol: sx_q4_linear)")


def test_the_kernel_directory_is_this_users_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path))
    fresh = tmp_path
    (fresh / "kernels").mkdir(mode=0o777)
    (fresh / "kernels").chmod(0o777)
    assert stat.S_IMODE(build._kernel_dir().stat().st_mode) == 0o700
