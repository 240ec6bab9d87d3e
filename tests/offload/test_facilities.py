"""The stand-ins for POSIX-only facilities (offload/platform/facilities.py, offload/cache/locking.py,
offload/platform/mounts.py, cli/errors.py), each taken on its own on this Linux machine: positional reads and writes
without preadv/pread/pwrite, reads past the page cache via F_NOCACHE (macOS) or not at all, lock files via msvcrt
(Windows, faked) or a lock directory (stale owners broken, live and foreign ones waited for), SIGTERM absent, cache
directory names from Windows paths, and the WSL2 slow-mount warning from a fake mount table. The offload and cache
suites run whole without these facilities too (conftest.posix_facilities)."""
from __future__ import annotations

import errno
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path, PureWindowsPath
from types import SimpleNamespace

import pytest
import torch

from cli import errors
from cli.main import main
from offload.platform import facilities
from offload.cache import locking
from offload.cache.identity import cache_dir_for
from offload.cache.locking import LockTimeout, exclusive_lock
from offload.platform.mounts import mount_of, slow_mount_warnings

DATA = random.Random(0).randbytes(16384)      # no two blocks alike: a read from a wrong offset shows


@pytest.fixture()
def data_file(tmp_path: Path) -> Path:
    path = tmp_path / "data.bin"
    path.write_bytes(DATA)
    return path


def read_all(fd: int, chunk: int) -> bytes:
    out = bytearray(len(DATA) + 100)
    view, done = memoryview(out), 0
    while n := facilities.pread_into(fd, view[done:done + chunk], done):
        done += n
    return bytes(out[:done])


# ------------------------------------------------------------------------------------------------ reads, writes

@pytest.mark.parametrize("without", [(), ("preadv",), ("preadv", "pread")], ids=["preadv", "pread", "seek"])
def test_positional_reads_give_the_same_bytes_with_each_stand_in(data_file: Path, monkeypatch, without) -> None:
    for name in without:
        monkeypatch.delattr(os, name)
    fd = facilities.open_read(data_file)
    try:
        assert read_all(fd, 5000) == DATA                      # short last read, then 0 at the end
        view = memoryview(bytearray(10))
        assert facilities.pread_into(fd, view, len(DATA) - 4) == 4 and bytes(view[:4]) == DATA[-4:]
    finally:
        os.close(fd)


def test_the_seek_stand_in_is_safe_from_many_threads(data_file: Path, monkeypatch) -> None:
    monkeypatch.delattr(os, "preadv")
    monkeypatch.delattr(os, "pread")
    fd = facilities.open_read(data_file)
    bad: list[int] = []

    def reader(k: int) -> None:
        buf = memoryview(bytearray(256))
        for _ in range(200):
            offset = (k * 997 % 64) * 256
            facilities.pread_into(fd, buf, offset)
            if bytes(buf) != DATA[offset:offset + 256]:
                bad.append(k)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.close(fd)
    assert bad == []


@pytest.mark.parametrize("without_pwrite", [False, True])
def test_positional_writes(tmp_path: Path, monkeypatch, without_pwrite: bool) -> None:
    if without_pwrite:
        monkeypatch.delattr(os, "pwrite")
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        facilities.pwrite_all(fd, DATA[8192:], 8192)
        facilities.pwrite_all(fd, memoryview(DATA)[:8192], 0)
    finally:
        os.close(fd)
    assert path.read_bytes() == DATA


def test_unbuffered_reads_use_f_nocache_where_o_direct_is_missing(data_file: Path, monkeypatch) -> None:
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    assert facilities.open_unbuffered(data_file) is None       # Linux without O_DIRECT: no way to skip the cache
    calls = []
    fake = SimpleNamespace(F_NOCACHE=48, fcntl=lambda fd, op, arg: calls.append((op, arg)))
    monkeypatch.setitem(sys.modules, "fcntl", fake)           # what macOS offers
    fd = facilities.open_unbuffered(data_file)
    try:
        assert fd is not None and calls == [(48, 1)] and read_all(fd, 4096) == DATA
    finally:
        os.close(fd)
    assert facilities.open_unbuffered(data_file.with_name("absent")) is None


def test_without_fadvise_or_directory_fsync_nothing_is_done(data_file: Path, monkeypatch) -> None:
    for name in ("posix_fadvise", "O_DIRECTORY"):
        monkeypatch.delattr(os, name, raising=False)
    monkeypatch.setattr(os, "fsync", lambda fd: pytest.fail("no directory can be opened here"))
    fd = facilities.open_read(data_file)
    facilities.advise_sequential(fd)
    facilities.drop_cached(fd, 0, len(DATA))
    os.close(fd)
    facilities.fsync_dir(data_file.parent)
    assert "posix_fadvise" in facilities.missing() and "directory fsync" in facilities.missing()


def test_pid_alive() -> None:
    assert facilities.pid_alive(os.getpid())
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not facilities.pid_alive(int(proc.stdout))          # exited and reaped


# ------------------------------------------------------------------------------------------------ locks

class FakeMsvcrt:
    """Windows byte-range locks as msvcrt.locking exposes them: per handle (so two descriptors of one process
    exclude each other), from the current position, LK_NBLCK failing at once with EACCES."""

    LK_UNLCK, LK_NBLCK = 0, 2

    def __init__(self) -> None:
        self.held: dict[tuple, int] = {}
        self.calls: list[tuple[int, int]] = []

    def locking(self, fd: int, mode: int, nbytes: int) -> None:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, os.lseek(fd, 0, os.SEEK_CUR), nbytes)
        self.calls.append((mode, key[2]))
        if mode == self.LK_NBLCK:
            if key in self.held:
                raise PermissionError(errno.EACCES, "Permission denied")
            self.held[key] = fd
        elif self.held.pop(key, None) != fd:
            raise PermissionError(errno.EACCES, "Permission denied")


def hold_in_thread(lock: Path, release: threading.Event) -> threading.Thread:
    held = threading.Event()

    def run() -> None:
        with exclusive_lock(lock):
            held.set()
            release.wait(30)

    t = threading.Thread(target=run)
    t.start()
    assert held.wait(30)
    return t


def test_msvcrt_locks_exclude_waiters_and_leave_the_pid_readable(tmp_path: Path, monkeypatch) -> None:
    fake = FakeMsvcrt()
    monkeypatch.setitem(sys.modules, "fcntl", None)
    monkeypatch.setitem(sys.modules, "msvcrt", fake)
    lock, release = tmp_path / "x.lock", threading.Event()
    holder = hold_in_thread(lock, release)
    assert lock.read_text().strip() == str(os.getpid())                # readable: the locked byte lies past it
    log: list[str] = []
    with pytest.raises(LockTimeout, match="timed out after 0.2 s"):
        with exclusive_lock(lock, timeout=0.2, log=log.append):
            pass
    assert log == [f"waiting for process {os.getpid()}, which is building {tmp_path / 'x'}"]
    threading.Timer(0.2, release.set).start()
    with exclusive_lock(lock, timeout=30):
        assert release.is_set()                                       # got it only once the holder let go
    holder.join()
    assert fake.held == {} and {pos for _, pos in fake.calls} == {locking.MSVCRT_BYTE}
    assert not lock.with_name("x.lock.d").exists()


def test_a_file_system_refusing_flock_gets_a_lock_directory(tmp_path: Path, monkeypatch) -> None:
    def flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    import fcntl
    monkeypatch.setitem(sys.modules, "fcntl", SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX,
                                                             LOCK_NB=fcntl.LOCK_NB, LOCK_UN=fcntl.LOCK_UN))
    lock, release = tmp_path / "x.lock", threading.Event()
    holder = hold_in_thread(lock, release)
    owner = (tmp_path / "x.lock.d" / "owner").read_text().split()
    assert owner[:2] == [str(os.getpid()), socket.gethostname()]
    with pytest.raises(LockTimeout):
        with exclusive_lock(lock, timeout=0.2):
            pass
    release.set()
    holder.join()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.lock"]   # the directory went with the holder


def lock_dir_left_by(tmp_path: Path, owner: str | None, age: float = 0.0) -> Path:
    d = tmp_path / "x.lock.d"
    d.mkdir()
    if owner is not None:
        (d / "owner").write_text(owner + "\n")
    if age:
        past = time.time() - age
        os.utime(d, (past, past))
    return tmp_path / "x.lock"


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


@pytest.mark.parametrize("owner,age,broken", [
    ("dead", 0.0, True),                     # its process is gone: taken at once
    (None, 0.0, False),                      # being made this instant: waited for
    (None, 2 * locking.ORPHAN_S, True),      # made long ago, never owned (its maker died at once): taken
    ("alive", 0.0, False),                   # a live process: waited for
    ("other host", 0.0, False),              # cannot be checked from here: waited for
], ids=["dead owner", "fresh orphan", "old orphan", "live owner", "other host"])
def test_lock_directories_are_broken_only_when_their_owner_is_dead(tmp_path: Path, monkeypatch, owner, age,
                                                                     broken: bool) -> None:
    monkeypatch.setitem(sys.modules, "fcntl", None)
    text = {"dead": f"{dead_pid()} {socket.gethostname()} t", "alive": f"{os.getppid()} {socket.gethostname()} t",
            "other host": f"{os.getpid() + 1} elsewhere.example t", None: None}[owner]
    lock = lock_dir_left_by(tmp_path, text, age)
    log: list[str] = []
    if broken:
        with exclusive_lock(lock, timeout=5, log=log.append):
            assert (tmp_path / "x.lock.d" / "owner").read_text().split()[0] == str(os.getpid())
        assert log == [] and not (tmp_path / "x.lock.d").exists()
    else:
        with pytest.raises(LockTimeout):
            with exclusive_lock(lock, timeout=0.3, log=log.append):
                pass
        assert (tmp_path / "x.lock.d").exists() and len(log) == 1
    assert not (tmp_path / "x.lock.d.break").exists()


def test_two_waiters_break_a_dead_lock_once(tmp_path: Path, monkeypatch) -> None:
    """Several threads find the same dead owner's directory: each ends up holding the lock alone."""
    monkeypatch.setitem(sys.modules, "fcntl", None)
    lock = lock_dir_left_by(tmp_path, f"{dead_pid()} {socket.gethostname()} t")
    inside, most, errs = [0], [0], []

    def take() -> None:
        try:
            with exclusive_lock(lock, timeout=30):
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                time.sleep(0.02)
                inside[0] -= 1
        except BaseException as e:  # noqa: BLE001 -- reported below
            errs.append(e)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errs == [] and most[0] == 1


# ------------------------------------------------------------------------------------------------ signals

def test_without_sigterm_the_cli_still_runs_and_ctrl_c_still_stops(monkeypatch) -> None:
    monkeypatch.delattr(signal, "SIGTERM")
    before = signal.getsignal(signal.SIGINT)
    with errors.sigterm_raises():
        pass
    assert signal.getsignal(signal.SIGINT) is before
    assert main(["models", "--json"]) == 0
    with pytest.raises(KeyboardInterrupt):
        with errors.sigterm_raises():
            signal.raise_signal(signal.SIGINT)


def test_sigterm_raises_terminated_where_it_exists() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(errors.Terminated):
        with errors.sigterm_raises():
            signal.raise_signal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == (signal.SIG_DFL if before is None else before)


# ------------------------------------------------------------------------------------------------ paths

WINDOWS_RESERVED = set('<>:"/\\|?*') | {chr(c) for c in range(32)}


@pytest.mark.parametrize("path", [r"C:\Users\Some One\models\x", r"D:\models\Qwen2.5 7B: instruct?",
                                  "C:\\", r"\\server\share\.hidden model", "C:\\m\\" + "y" * 300])
def test_cache_directory_names_from_windows_paths_are_valid_file_names(path: str) -> None:
    options = {"version": 1, "checkpoint": path, "format": "nf4", "dtype": "float32", "double_quant": False}
    name = cache_dir_for(PureWindowsPath(path), options, Path("/cache")).name
    assert not set(name) & WINDOWS_RESERVED and not name.startswith(".") and name[-1] not in ". "
    assert len(name) <= 120 and name.endswith("-nf4-float32-" + name.rsplit("-", 1)[1])
    other = cache_dir_for(PureWindowsPath(path + "2"), dict(options, checkpoint=path + "2"), Path("/cache"))
    assert other.name != name                                # the options' hash keeps them apart


# ------------------------------------------------------------------------------------------------ WSL2 mounts

def fake_mounts(tmp_path: Path, windows_drive: Path) -> Path:
    table = tmp_path / "mounts"
    drive = str(windows_drive).replace(" ", "\\040")
    table.write_text("none / ext4 rw 0 0\n"
                     f"C:\\134 {drive} 9p rw,aname=drvfs;path=C:\\134 0 0\n"
                     f"tmpfs {drive}d tmpfs rw 0 0\n")
    return table


def test_mount_of_finds_the_longest_mount_point_and_follows_symlinks(tmp_path: Path) -> None:
    drive = tmp_path / "mnt" / "c drive"
    table = fake_mounts(tmp_path, drive)
    assert mount_of(drive / "Users" / "x", table) == (str(drive), "9p")
    assert mount_of(drive, table) == (str(drive), "9p")
    assert mount_of(Path(str(drive) + "d") / "y", table)[1] == "tmpfs"   # /mnt/c drived is not under /mnt/c drive
    assert mount_of(tmp_path / "home", table) == ("/", "ext4")
    (drive / "cache").mkdir(parents=True)
    (tmp_path / "link").symlink_to(drive / "cache")
    assert mount_of(tmp_path / "link" / "specexec", table) == (str(drive), "9p")
    assert mount_of(tmp_path, tmp_path / "no-such-table") is None


def test_slow_mount_warnings_name_the_path_and_a_linux_side_one(tmp_path: Path) -> None:
    drive = tmp_path / "mnt" / "c"
    table = fake_mounts(tmp_path, drive)
    cache_line, = slow_mount_warnings(tmp_path / "home" / "model", drive / "cache", table)
    assert "the layer cache" in cache_line and "9p" in cache_line and "~/.cache/specexec" in cache_line
    assert "SPECEXEC_CACHE" in cache_line and "\n" not in cache_line
    model_line, = slow_mount_warnings(drive / "models" / "x", None, table)
    assert "the model" in model_line and "HF_HOME=~/.cache/huggingface" in model_line
    assert slow_mount_warnings(tmp_path / "a", tmp_path / "b", table) == ()


def test_the_plan_warns_when_the_cache_or_the_model_is_on_a_windows_drive(tiny_llama: Path, tmp_path: Path,
                                                                          monkeypatch, capsys) -> None:
    from offload.platform import mounts
    from specexec.config import EngineConfig, OffloadConfig
    from specexec.checkpoints.loading import read_args
    from specexec.planning.target import plan_target

    drive = tmp_path / "mnt" / "c"
    monkeypatch.setattr(mounts, "MOUNTS", fake_mounts(tmp_path, drive))
    args = read_args(tiny_llama)
    plan = plan_target(tiny_llama, args, None, OffloadConfig(offload="ssd", quant="nf4", cache_dir=str(drive / "c")),
                       EngineConfig(), torch.device("cpu"), torch.float32)
    warned = [ln for ln in plan.notice().splitlines() if "9p mount" in ln]
    assert len(warned) == 1 and "the layer cache" in warned[0] and "~/.cache/specexec" in warned[0]
    resident = plan_target(tiny_llama, args, None, OffloadConfig(offload="none", quant="none",
                                                                 cache_dir=str(drive / "c")),
                           EngineConfig(), torch.device("cpu"), torch.float32)
    assert "9p" not in resident.notice()                     # nothing read from the cache: nothing to say

    monkeypatch.setenv("SPECEXEC_CACHE", str(drive / "cache"))
    assert main(["plan", "--model", str(tiny_llama), "--device", "cpu", "--offload", "ssd", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert any("the layer cache" in w and "9p" in w for w in out["warnings"])
