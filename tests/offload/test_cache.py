"""offload.cache.store: build + reuse, byte-exact round trip against direct quantization, corruption and staleness
detection (rebuilt with a message), atomicity under a crash mid-write, lock handling (dead holder, concurrent
builder), disk-full handling, and the `specexec convert` command in-process; each with this machine's facilities
and again without the POSIX-only ones (O_DIRECT, preadv, fadvise, flock, SIGTERM: what Windows lacks)."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cli.main import main
from cpu_kernels.cache_root import default_cache_root
from offload.cache import store as C
from offload.cache.identity import cache_dir_for, options_of
from offload.cache.reading import _VERIFIED, aligned_empty
from offload.cache.manifest import CacheCorruptError, CacheError
from offload.platform import facilities
from offload.cache.store import LayerCache
from offload.formats.checkpoint import SafetensorsCheckpoint
from offload.quant.linear import QuantLinear, bind_module, swap_linears
from offload.quant.weights import quantize_tensors
from offload.streaming.storage import ALIGN, unpack_layer
from specexec.checkpoints.loading import read_args
from specexec.network.model import Block
from specexec.checkpoints.naming import layer_names


# Every test runs twice: natively, and with the POSIX-only facilities taken away (conftest.posix_facilities).
pytestmark = pytest.mark.usefixtures("posix_facilities")


@pytest.fixture()
def model(tiny_llama: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny Llama (tests touch its files)."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "llama"))


def build(model: Path, root: Path, fmt: str = "nf4", log: list[str] | None = None, **kw) -> LayerCache:
    sources = layer_names(model, read_args(model))
    return LayerCache.open_or_build(model, sources, fmt, torch.float32, cache_root=root, progress=False,
                                    log=(log.append if log is not None else None), **kw)


def fresh_process() -> None:
    """Forget which files this process already verified (what a new process would see)."""
    _VERIFIED.clear()


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_build_then_reuse(model: Path, tmp_path: Path) -> None:
    first = build(model, tmp_path / "c")
    assert first.built and first.n_layers == 2 and first.file.name == "layers.bin"
    assert first.file.stat().st_size == first.total_nbytes == sum(first.nbytes(i) for i in range(2))
    assert all(first.offset(i) % ALIGN == 0 and first.nbytes(i) % ALIGN == 0 for i in range(2))
    first.close()
    fresh_process()
    second = build(model, tmp_path / "c")
    assert not second.built and second.path == first.path
    assert [p.name for p in (tmp_path / "c").iterdir() if p.name.startswith(".")] == [".locks"]   # no temp dirs


@pytest.mark.parametrize("fmt,double_quant", [("nf4", False), ("nf4", True), ("fp4", False), ("int8", False),
                                              ("none", False)])
def test_every_layer_round_trips_to_direct_quantization(tiny_qwen2: Path, tmp_path: Path, fmt: str,
                                                        double_quant: bool) -> None:
    sources = layer_names(tiny_qwen2, read_args(tiny_qwen2))             # qwen2: q/k/v biases too
    cache = LayerCache.open_or_build(tiny_qwen2, sources, fmt, torch.float32, cache_root=tmp_path,
                                     double_quant=double_quant, progress=False)
    ckpt = SafetensorsCheckpoint(tiny_qwen2)
    for i, src in enumerate(sources):
        direct, meta = quantize_tensors({p: ckpt.get(c) for p, c in src.tensors.items()}, fmt, torch.float32,
                                        src.linear, double_quant)
        views = unpack_layer(cache.read_layer(i), cache.layout(i))
        assert cache.layout(i).meta == meta and list(views) == list(direct)
        for name, t in direct.items():
            assert torch.equal(views[name], t), (i, name)


def test_cached_layer_binds_to_a_block(model: Path, tmp_path: Path) -> None:
    args = read_args(model)
    cache = build(model, tmp_path, "int8")
    ref = Block(args)
    with torch.device("meta"):
        block = Block(args)
    swap_linears(block, "int8", torch.float32)
    buf = cache.read_layer(1)
    bind_module(block, unpack_layer(buf, cache.layout(1)), cache.layout(1).meta)
    assert isinstance(block.mlp.down_proj, QuantLinear)
    ckpt = SafetensorsCheckpoint(model)
    ref.load_state_dict({p: ckpt.get(c) for p, c in layer_names(model, args)[1].tensors.items()})
    x = torch.randn(1, 5, args.dim)
    assert torch.allclose(block.mlp(x), ref.mlp(x), rtol=0.05, atol=0.05 * ref.mlp(x).abs().max().item())


def test_read_layer_into_given_buffers(model: Path, tmp_path: Path) -> None:
    cache = build(model, tmp_path)
    want = cache.read_layer(1, direct=False)
    slot = aligned_empty(cache.max_nbytes + ALIGN)
    got = cache.read_layer(1, slot)
    assert got.data_ptr() == slot.data_ptr() and torch.equal(got, want)
    odd = torch.zeros(cache.max_nbytes + 64, dtype=torch.uint8)[64:]      # 64-aligned, maybe not 4 KiB-aligned
    assert torch.equal(cache.read_layer(1, odd), want)                    # falls back to a buffered read
    if cache.direct_io:
        assert torch.equal(cache.read_layer(1, slot, direct=True), want)
        if odd.data_ptr() % ALIGN:
            with pytest.raises(CacheError, match="O_DIRECT"):
                cache.read_layer(1, odd, direct=True)
    with pytest.raises(ValueError, match="holds"):
        cache.read_layer(1, torch.zeros(16, dtype=torch.uint8))


class ReadCounter:
    """Counts positional reads and bytes (every layer read of offload.cache.store and offload.streaming.tiers goes
    through facilities.pread_into: os.preadv, or its stand-in)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls, self.nbytes, real = 0, 0, facilities.pread_into

        def pread_into(fd, view, offset):
            got = real(fd, view, offset)
            self.calls += 1
            self.nbytes += got
            return got

        monkeypatch.setattr(facilities, "pread_into", pread_into)


def test_opening_a_cache_reads_no_layer_bytes(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Startup checks sizes, manifest and fingerprint only; each layer is read (and checksummed) when a pass
    first needs it, once; the RAM tier's fill reads each of its layers once."""
    from offload.streaming.pager import build_pager

    with build(model, tmp_path) as first:
        want = [first.read_layer(i).clone() for i in range(first.n_layers)]
    fresh_process()                                                        # a new process: nothing checked yet
    reads = ReadCounter(monkeypatch)
    cache = build(model, tmp_path)
    assert not cache.built and (reads.calls, reads.nbytes) == (0, 0)
    with build_pager(["ssd"] * cache.n_layers, cache, "cpu", n_slots=1) as pager:
        assert reads.nbytes == 0                                           # nothing before the first pass
        for i, buf in pager.layers():
            assert torch.equal(buf, want[i])
        assert reads.nbytes == cache.total_nbytes                          # each layer once, checked as read
    assert {cache._file.key + (i,) for i in range(cache.n_layers)} <= _VERIFIED
    fresh_process()
    reads.nbytes = 0
    with build_pager(["ram"] * cache.n_layers, cache, "cpu"):
        assert reads.nbytes == cache.total_nbytes                          # the RAM fill: each layer once


def test_a_corrupt_layer_is_caught_on_first_read_and_the_next_open_rebuilds(model: Path, tmp_path: Path) -> None:
    cache = build(model, tmp_path)
    good = cache.read_layer(1).clone()
    cache.close()
    flip_byte(cache.file, cache.offset(1) + 100)
    fresh_process()
    log: list[str] = []
    opened = build(model, tmp_path, log=log)                               # startup does not read layer 1
    assert not opened.built and log == []
    opened.read_layer(0)
    with pytest.raises(CacheCorruptError) as e:
        opened.read_layer(1)                                               # the first read checks it
    message = str(e.value)
    assert "\n" not in message and "layer 1 fails its checksum" in message and "next run rebuilds it" in message
    assert str(opened.file) in message
    with pytest.raises(CacheCorruptError, match="layer 1 fails"):
        opened.verify(1)
    again = build(model, tmp_path, log=log)
    assert again.built and len(log) == 1 and "found corrupt" in log[0] and "layer 1 fails its checksum" in log[0]
    assert log[0].endswith("rebuilding it")
    assert torch.equal(again.read_layer(1), good)


def test_a_corrupt_streamed_layer_ends_a_run_with_one_line_and_the_next_run_rebuilds(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    root = tmp_path / "cache"
    argv = ["generate", "--model", str(model), "--no-draft", "--prompt", "Hello", "--max-new-tokens", "4",
            "--offload", "ssd", "--quant", "none", "--cache-dir", str(root), "--json"]
    assert main(argv) == 0
    clean = json.loads(capsys.readouterr().out)["token_ids"]
    cache = next(p for p in root.iterdir() if p.is_dir() and p.name != ".locks")
    with LayerCache.open(cache) as c:
        flip_byte(c.file, c.offset(1) + 64)
    fresh_process()
    assert main(argv) == 2                                                 # found by the read-ahead thread
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "loading layer 1 failed" in lines[0] and "fails its checksum" in lines[0] and "rebuilds" in lines[0]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["token_ids"] == clean and "rebuilding it" in captured.err


def test_explicit_checks_still_read_everything(model: Path, tmp_path: Path) -> None:
    cache = build(model, tmp_path)
    assert cache.verify_all() == cache.total_nbytes                        # after a build: the file, re-read
    fresh_process()
    with LayerCache.open(cache.path, verify=True) as checked:              # the full check on open
        assert checked.verify_all(memo=True) == 0                          # ... memoized for this process
    flip_byte(cache.file, cache.offset(0) + 7)
    fresh_process()
    with pytest.raises(CacheCorruptError, match="layer 0 fails its checksum"):
        LayerCache.open(cache.path, verify=True)
    with pytest.raises(CacheCorruptError, match="found corrupt"):
        LayerCache.open(cache.path)


def test_truncated_file_is_detected_even_without_checksums(model: Path, tmp_path: Path) -> None:
    cache = build(model, tmp_path)
    os.truncate(cache.file, cache.total_nbytes - 1000)
    log: list[str] = []
    again = build(model, tmp_path, log=log, verify=False)
    assert again.built and any("truncated" in m for m in log)
    assert again.file.stat().st_size == again.total_nbytes


@pytest.mark.parametrize("garbage", [b"{not json", b"[]", b'{"version": 1}', b"\xff\xfe"])
def test_garbage_manifest_is_detected(model: Path, tmp_path: Path, garbage: bytes) -> None:
    cache = build(model, tmp_path)
    (cache.path / "manifest.json").write_bytes(garbage)
    log: list[str] = []
    assert build(model, tmp_path, log=log).built
    assert len(log) == 1 and "not a valid manifest" in log[0] and "rebuilding" in log[0]


def test_changed_checkpoint_makes_the_cache_stale(model: Path, tmp_path: Path) -> None:
    cache = build(model, tmp_path)
    st = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    log: list[str] = []
    again = build(model, tmp_path, log=log)
    assert again.built and again.path == cache.path
    assert log == [f"{cache.path} is stale: model.safetensors changed since it was built; rebuilding it"]


def test_weights_swapped_with_the_same_size_and_mtime_make_the_cache_stale(model: Path, tmp_path: Path) -> None:
    """Other weights of the same shapes written over model.safetensors, its size and mtime kept: the cache's
    fingerprint samples the bytes, so it is rebuilt (with one line saying why) instead of serving the old layers
    beside the new embedding and head."""
    cache = build(model, tmp_path)
    first = cache.read_layer(0).clone()
    from safetensors.torch import load_file, save_file

    weights = model / "model.safetensors"
    st = weights.stat()
    other = {k: v + 0.01 * torch.randn_like(v) for k, v in load_file(weights).items()}
    save_file(other, tmp_path / "other.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "other.safetensors").stat().st_size == st.st_size     # same names and shapes: same size
    os.replace(tmp_path / "other.safetensors", weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    log: list[str] = []
    again = build(model, tmp_path, log=log)
    assert again.built and again.path == cache.path
    assert log == [f"{cache.path} is stale: model.safetensors's bytes changed since it was built, though its size "
                   "and modification time did not (the file was swapped); rebuilding it"]
    assert not torch.equal(again.read_layer(0), first)


def test_other_options_get_their_own_cache(model: Path, tmp_path: Path) -> None:
    a, b = build(model, tmp_path, "nf4"), build(model, tmp_path, "int8")
    c = build(model, tmp_path, "nf4", double_quant=True)
    assert len({a.path, b.path, c.path}) == 3 and all(x.built for x in (a, b, c))


def test_crash_mid_write_leaves_no_cache(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real, calls = C._write_layer, []

    def crash_after_first(fd: int, buf: torch.Tensor, offset: int) -> None:
        if calls:
            raise RuntimeError("simulated crash")
        calls.append(offset)
        real(fd, buf, offset)

    monkeypatch.setattr(C, "_write_layer", crash_after_first)
    with pytest.raises(RuntimeError, match="simulated crash"):
        build(model, tmp_path / "c")
    assert [p.name for p in (tmp_path / "c").iterdir()] == [".locks"]             # no final dir, temp dir removed
    monkeypatch.setattr(C, "_write_layer", real)
    assert build(model, tmp_path / "c").built


def test_leftovers_of_a_killed_builder_are_ignored_and_removed(model: Path, tmp_path: Path) -> None:
    cache = build(model, tmp_path)
    shutil.rmtree(cache.path)
    junk = cache.path.with_name(f".{cache.path.name}.tmp-4194304")
    junk.mkdir()
    (junk / "layers.bin").write_bytes(b"half a layer")
    fresh_process()
    again = build(model, tmp_path)
    assert again.built and not junk.exists()


def lock_path(model: Path, root: Path, fmt: str = "nf4") -> Path:
    options = options_of(model.resolve(), layer_names(model, read_args(model)), fmt, torch.float32, False)
    final = cache_dir_for(model.resolve(), options, root)
    return final.parent / ".locks" / (final.name + ".lock")


# Takes the cache's lock as this test's mode does (native; or with fcntl unimportable: a lock directory), says
# "held", optionally waits for a line on stdin, then SIGKILLs itself while holding the lock.
HOLD_AND_DIE = """
import os, pathlib, signal, sys
if sys.argv[2] == "fallback":
    sys.modules["fcntl"] = None
from offload.cache.locking import exclusive_lock
with exclusive_lock(pathlib.Path(sys.argv[1])):
    print("held", flush=True)
    if sys.argv[3:] == ["wait"]:
        sys.stdin.readline()
    os.kill(os.getpid(), signal.SIGKILL)
"""
REPO = Path(__file__).resolve().parents[2]


def test_lock_left_by_a_dead_process_is_recovered(model: Path, tmp_path: Path, posix_facilities: str) -> None:
    lock = lock_path(model, tmp_path)
    proc = subprocess.run([sys.executable, "-c", HOLD_AND_DIE, str(lock), posix_facilities], cwd=REPO,
                          stdout=subprocess.DEVNULL)
    assert proc.returncode == -signal.SIGKILL and lock.read_text().strip().isdigit()
    assert lock.with_name(lock.name + ".d").is_dir() == (posix_facilities == "fallback")   # a dead owner's dir
    log: list[str] = []
    assert build(model, tmp_path, log=log, lock_timeout=10).built          # raises if it waited 10 s
    assert not any("waiting" in m for m in log)                               # it never waited at all
    assert sorted(p.name for p in lock.parent.iterdir()) == [lock.name]          # dir and breaker gone
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".lock")]  # none beside the caches


def test_a_holder_killed_while_another_waits_frees_the_lock(model: Path, tmp_path: Path, posix_facilities: str
                                                             ) -> None:
    lock = lock_path(model, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_DIE, str(lock), posix_facilities, "wait"], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        log: list[str] = []
        built: list[LayerCache] = []
        waiter = threading.Thread(target=lambda: built.append(build(model, tmp_path, log=log, lock_timeout=30)))
        waiter.start()
        deadline = time.monotonic() + 30
        while not any(m.startswith(f"waiting for process {holder.pid}") for m in log):
            assert time.monotonic() < deadline and waiter.is_alive(), log
            time.sleep(0.02)
        holder.stdin.write("die\n")                                    # the holder SIGKILLs itself now
        holder.stdin.flush()
        assert holder.wait(30) == -signal.SIGKILL
        waiter.join(30)
        assert not waiter.is_alive() and built and built[0].built
    finally:
        holder.kill()
        holder.wait()


def test_second_builder_waits_then_reuses(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real, started = C._write_layer, threading.Event()

    def slow(fd: int, buf: torch.Tensor, offset: int) -> None:
        started.set()
        time.sleep(0.3)
        real(fd, buf, offset)

    monkeypatch.setattr(C, "_write_layer", slow)
    results: dict[str, LayerCache] = {}
    first = threading.Thread(target=lambda: results.update(a=build(model, tmp_path)))
    first.start()
    assert started.wait(30)
    log: list[str] = []
    results["b"] = build(model, tmp_path, log=log, lock_timeout=60)       # blocks on the lock meanwhile
    first.join()
    assert results["a"].built and not results["b"].built and results["a"].path == results["b"].path
    assert any(m.startswith(f"waiting for process {os.getpid()}") for m in log)


def test_lock_timeout_is_a_clear_error(model: Path, tmp_path: Path) -> None:
    with C.exclusive_lock(lock_path(model, tmp_path)):
        with pytest.raises(CacheError, match="timed out after 0.2 s waiting for the lock"):
            build(model, tmp_path, lock_timeout=0.2)


def test_not_enough_disk_space(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 5000, 5000))
    with pytest.raises(CacheError, match=r"not enough disk space .*: needs [\d.]+ GB, 0\.0000050 GB free"):
        build(model, tmp_path / "c")
    assert [p.name for p in (tmp_path / "c").iterdir()] == [".locks"]
    monkeypatch.undo()
    assert build(model, tmp_path / "c").built


def test_disk_full_while_writing(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, buf: torch.Tensor, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(C, "_write_layer", full)
    with pytest.raises(CacheError, match="disk full while writing the layer cache"):
        build(model, tmp_path / "c")
    assert [p.name for p in (tmp_path / "c").iterdir()] == [".locks"]
    monkeypatch.undo()
    assert build(model, tmp_path / "c").built


def test_default_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "a"))
    assert default_cache_root() == tmp_path / "a"
    monkeypatch.delenv("SPECEXEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_root() == tmp_path / "x" / "specexec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_root() == Path.home() / ".cache" / "specexec"


def test_convert_command(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cache"
    assert main(["convert", "--model", str(model), "--quant", "int8", "--out", str(root)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(str(root)) and "(built): 2 layers, int8, float32" in out
    assert "quantizing to int8" in err                                     # the progress bar, on stderr
    assert main(["convert", "--model", str(model), "--quant", "int8", "--out", str(root), "--no-progress"]) == 0
    assert "already up to date" in capsys.readouterr().out
    assert main(["convert", "--model", str(model), "--quant", "nf4", "--dtype", "bfloat16", "--double-quant",
                 "--out", str(root), "--no-progress"]) == 0
    assert "nf4, bfloat16" in capsys.readouterr().out


def test_convert_verify_checks_every_layer(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "cache"
    argv = ["convert", "--model", str(model), "--quant", "int8", "--out", str(root), "--verify"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "(built)" in out and "verified: 2 layers" in out and "every sha256 matches" in out
    assert "verifying" in err                                              # the progress bar
    cache = next(p for p in root.iterdir() if p.is_dir() and p.name != ".locks")
    flip_byte(cache / "layers.bin", 5000)
    reads = ReadCounter(monkeypatch)
    assert main(argv + ["--no-progress"]) == 2                             # the full check finds it
    out, err = capsys.readouterr()
    assert "already up to date" in out and reads.nbytes > 0
    assert err.startswith("error: ") and err.count("\n") == 1 and "fails its checksum" in err
    assert main(argv + ["--no-progress"]) == 0                             # marked: this run rebuilds
    out, err = capsys.readouterr()
    assert "(built)" in out and "verified: 2 layers" in out and "found corrupt" in err


def test_convert_errors_are_one_line(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["convert", "--model", str(tmp_path / "nope"), "--quant", "nf4"]) == 2
    assert capsys.readouterr().err.startswith("error: model path")
    assert main(["convert", "--model", str(model), "--quant", "q3"]) == 2
    assert "unknown --quant 'q3'; choose one of" in capsys.readouterr().err
    monkeypatch.setattr(C.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 0))
    assert main(["convert", "--model", str(model), "--quant", "nf4", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: not enough disk space") and err.count("\n") == 1


def test_each_expert_is_a_region_read_alone_and_checked_alone(tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    """A sparse layer's experts are separate 4 KiB-aligned regions: one is read alone (O_DIRECT-able offsets),
    equals its bytes in the whole layer, and a corrupt expert fails its own checksum on its first read."""
    model = Path(shutil.copytree(tiny_qwen3_moe, tmp_path / "moe"))
    args = read_args(model)
    cache = LayerCache.open_or_build(model, layer_names(model, args), "int8", torch.float32, cache_root=tmp_path,
                                     progress=False)
    lay = cache.layout(0)
    assert len(lay.regions) == args.moe.n_experts and cache.layout(1).regions == ()     # layer 1 is dense
    assert all(r.offset % ALIGN == 0 and r.nbytes % ALIGN == 0 for r in lay.regions)
    whole = cache.read_layer(0).clone()
    r = lay.region("mlp.experts.5.")
    assert torch.equal(cache.read_region(0, r.name, verify=True), whole[r.offset:r.offset + r.nbytes])
    cache.close()
    flip_byte(cache.file, cache.offset(2) + lay.region("mlp.experts.3.").offset + 10)
    fresh_process()
    opened = LayerCache.open(cache.path)
    opened.read_region(2, "mlp.experts.2.")                                      # its neighbour is fine
    with pytest.raises(CacheCorruptError, match="layer 2 part 4 fails its checksum"):
        opened.read_region(2, "mlp.experts.3.")
