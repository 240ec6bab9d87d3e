"""On-disk cache of quantized, packed decoder layers for one checkpoint + quantization format + dtype.

One directory per (checkpoint path, format, dtype, double quant, packing, layer naming) under the cache root
($SPECEXEC_CACHE, else $XDG_CACHE_HOME/specexec, else ~/.cache/specexec) holds:
  layers.bin     every layer packed by offload.storage, each at a 4 KiB-aligned offset and padded to 4 KiB, so
                 it can be read with O_DIRECT straight into aligned (pinned) buffers
  manifest.json  version, source fingerprint (name, size, mtime and header hash of config.json, the index and
                 every safetensors file), format, dtype, and per layer: offset, nbytes, sha256, packed layout

Building (LayerCache.open_or_build): under an exclusive flock on "<dir>.lock" (the kernel drops it when the
holder dies, so a lock left by a dead process never blocks; the file names the holder's pid for the waiting
message), quantize layer by layer from the checkpoint (peak RAM about one layer), write into a temporary
directory next to the final one, fsync, rename. Free space is checked first. A second process waits for the
lock, then reuses what the first built. Any exception (Ctrl-C and the CLI's SIGTERM included) removes the
temporary directory; a disk that fills up or a file-size limit (EFBIG: ulimit -f) part-way is a one-line
CacheError. One left by a killed process is removed by the next builder.

Trust: every open checks the manifest, the version, the source fingerprint, the build options and the exact
file size (a stale, truncated or garbled cache is rebuilt with a message, never used). With verify=True (the
default) every layer's sha256 is also checked the first time a process opens a given file (memoized per
process by device/inode/size/mtime; free right after a build, whose checksums came from the bytes written).
That costs one sequential read of the file (~1.6 GB/s of sha256 per core): callers that cannot afford it pass
verify=False and may check layers as they read them (read_layer(..., verify=True)) or call verify(i).

Does not know: models or architectures. The caller names, per layer, which checkpoint tensors make it up (under
the names the runtime binds them by) and which of them are linear weights to quantize (LayerNames).

CONTRACT (used by specexec/offloaded.py, offload/tiers.py's SSD tier and cli/convert.py):

    @dataclass(frozen=True)
    class LayerNames:
        tensors: Mapping[str, str]       # packed name (module-local, e.g. "mlp.up_proj.weight") -> checkpoint name
        linear: frozenset[str]           # packed names of the nn.Linear weights to quantize

    class LayerCache:
        @classmethod
        def open_or_build(cls, checkpoint_dir, layers: Sequence[LayerNames], fmt: str, dtype: torch.dtype, *,
                          cache_root=None, double_quant=False, verify=True, progress=True, lock_timeout=None,
                          log=None, quantize_device=None) -> LayerCache
        @classmethod
        def open(cls, path, verify=True, expect=None) -> LayerCache      # an existing cache dir, or CacheError
        path: Path (the cache dir); file: Path (layers.bin); built: bool (this call built it); manifest: dict
        n_layers, fmt, dtype (str), max_nbytes, total_nbytes, direct_io
        layout(i) -> storage.LayerLayout (meta = quant meta for quant.bind_module); nbytes(i); offset(i)
        read_layer(i, out=None, direct=None, verify=False) -> uint8 [nbytes(i)] (a view of out when given)
        verify(i, buffer=None); verify_all(memo=False); close(); context manager

    class CacheError(ValueError); class CacheCorruptError(CacheError)    # one-line messages; CLI exit 2
    default_cache_root() -> Path; aligned_empty(nbytes) -> uint8 tensor at a 4 KiB boundary
    plan(checkpoint_dir, layers, fmt, dtype, double_quant) -> list[LayerLayout]   # sizes from headers only
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import INDEX, SINGLE
from .sources import CheckpointSource, detect_format, is_gguf, open_source, tensor_specs
from .quant import check_format, dtype_name, layer_specs, packing, quantize_tensors
from .storage import ALIGN, LayerLayout, pack_layer, plan_layout, round_up

VERSION = 1
LAYERS_FILE = "layers.bin"
MANIFEST = "manifest.json"
SPACE_MARGIN = 64 << 20            # bytes kept free beyond the cache itself (manifest, filesystem slack)
_VERIFIED: set[tuple] = set()      # (realpath, st_dev, st_ino, st_size, st_mtime_ns) checked in this process

# safetensors header dtype codes -> torch dtypes (for planning sizes from headers alone)
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CacheError(ValueError):
    """A layer cache that cannot be built or used; the message names the path and the reason."""


class CacheCorruptError(CacheError):
    """A cache whose bytes or manifest do not match what was written (checksum, size, garbled manifest)."""


@dataclass(frozen=True)
class LayerNames:
    """Where one layer's tensors come from: packed name (as the runtime binds it, e.g. 'mlp.up_proj.weight')
    -> checkpoint tensor name ('model.layers.3.mlp.up_proj.weight'), in packing order; `linear` holds the
    packed names of the 2-D nn.Linear weights to quantize (every other tensor is cast to the dtype)."""
    tensors: Mapping[str, str]
    linear: frozenset[str]

    def to_dict(self) -> dict:
        return {"tensors": dict(self.tensors), "linear": sorted(self.linear)}


def human_bytes(n: float) -> str:
    for unit, size in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def default_cache_root() -> Path:
    """$SPECEXEC_CACHE, else $XDG_CACHE_HOME/specexec, else ~/.cache/specexec."""
    if os.environ.get("SPECEXEC_CACHE"):
        return Path(os.environ["SPECEXEC_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "specexec"


# ----------------------------------------------------------------------------------------- source identity

def _header(path: Path) -> tuple[bytes, dict]:
    """(raw header bytes, parsed header) of a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        raw = f.read(n)
    try:
        return raw, json.loads(raw)
    except ValueError as e:
        raise CacheError(f"{path}: unreadable safetensors header ({e})") from None


def _weight_files(checkpoint_dir: Path) -> list[Path]:
    index = checkpoint_dir / INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [checkpoint_dir / n for n in names]
    return [checkpoint_dir / SINGLE]


def fingerprint(checkpoint_dir: str | os.PathLike) -> list[list]:
    """[[file name, size, mtime_ns, sha256 of its header or whole text]] for config.json, the safetensors index
    and every weight file: changes whenever the checkpoint is rewritten, costs a few header reads. A .gguf
    file: its own name, size, mtime and header hash."""
    d = Path(checkpoint_dir)
    if is_gguf(d):
        return open_source(d).fingerprint()
    out = []
    for p in [d / "config.json", d / INDEX] + _weight_files(d):
        if not p.is_file():
            continue
        st = p.stat()
        head = _header(p)[0] if p.suffix == ".safetensors" else p.read_bytes()
        out.append([p.name, st.st_size, st.st_mtime_ns, hashlib.sha256(head).hexdigest()])
    return out


def source_specs(checkpoint_dir: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Checkpoint tensor name -> (dtype, shape), from the safetensors headers alone (GGUF, AWQ, GPTQ: the
    dense tensors their source returns, offload.sources)."""
    if detect_format(checkpoint_dir) != "safetensors":
        return tensor_specs(open_source(checkpoint_dir))
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for f in _weight_files(checkpoint_dir):
        for name, info in _header(f)[1].items():
            if name != "__metadata__":
                if info["dtype"] not in ST_DTYPES:
                    raise CacheError(f"{f}: tensor {name} has dtype {info['dtype']}, which the cache cannot pack")
                specs[name] = (ST_DTYPES[info["dtype"]], tuple(info["shape"]))
    return specs


def options_of(checkpoint_dir: Path, layers: Sequence[LayerNames], fmt: str, dtype: torch.dtype,
               double_quant: bool, device: str | torch.device | None = None) -> dict:
    """Everything that decides the cache's bytes besides the source files (stored in the manifest). `device`:
    where the layers are quantized; int4 packs for that device's kernel (quant.packing), int8 names its scheme."""
    dq = bool(double_quant and fmt in ("nf4", "fp4"))
    options = {"version": VERSION, "checkpoint": str(checkpoint_dir), "source_format": detect_format(checkpoint_dir),
               "format": fmt, "dtype": dtype_name(dtype), "double_quant": dq, "sources": [s.to_dict() for s in layers]}
    layout = packing(fmt, device or "cpu")
    return options if layout is None else {**options, "packing": layout}


def cache_dir_for(checkpoint_dir: Path, options: dict, cache_root: Path) -> Path:
    """<root>/<checkpoint name>-<fmt>-<dtype>[-dq]-<16 hex of the options' hash>."""
    key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in checkpoint_dir.name) or "model"
    dq = "-dq" if options["double_quant"] else ""
    return cache_root / f"{name}-{options['format']}-{options['dtype']}{dq}-{key}"


# ----------------------------------------------------------------------------------------- locking

@contextmanager
def exclusive_lock(lock_path: Path, timeout: float | None = None, log: Callable[[str], None] | None = None
                   ) -> Iterator[None]:
    """Hold an exclusive flock on lock_path; wait (polling, interruptible) while another process holds it.

    A lock file left by a dead process is free at once (the kernel releases flock locks when the holder
    exits); its content is only the holder's pid, for the waiting message."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, lock_path, timeout, log)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)                                   # closing the descriptor releases the lock


def _acquire(fd: int, lock_path: Path, timeout: float | None, log: Callable[[str], None] | None) -> None:
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
            raise CacheError(f"timed out after {timeout:g} s waiting for the lock {lock_path}")
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------- the cache

class LayerCache:
    """An opened, validated cache: layout(i), nbytes(i), offset(i), read_layer(i, out), verify(i).

    Reads are positional (os.preadv), so one LayerCache may be read from several threads at once."""

    def __init__(self, path: Path, manifest: dict, built: bool = False) -> None:
        self.path = Path(path)                          # the cache directory
        self.file = self.path / LAYERS_FILE
        self.manifest = manifest
        self.built = built                              # True when this call built it (tests, messages)
        self.layouts = [LayerLayout.from_dict(e["layout"]) for e in manifest["layers"]]
        self._fd = os.open(self.file, os.O_RDONLY)
        self._direct_fd: int | None = _open_direct(self.file)

    # -- opening

    @classmethod
    def open(cls, path: str | os.PathLike, verify: bool = True, expect: dict | None = None) -> LayerCache:
        """Open the cache directory `path`; CacheError/CacheCorruptError if it is unusable.

        expect: the options (options_of) and "fingerprint" it must have been built for, if any."""
        path = Path(path)
        manifest = _load_manifest(path)
        if expect is not None:
            _check_expected(path, manifest, expect)
        cache = cls(path, manifest)
        try:
            if verify:
                cache.verify_all(memo=True)
        except BaseException:
            cache.close()
            raise
        return cache

    @classmethod
    def open_or_build(cls, checkpoint_dir: str | os.PathLike, layers: Sequence[LayerNames], fmt: str,
                      dtype: torch.dtype, *, cache_root: str | os.PathLike | None = None, double_quant: bool = False,
                      verify: bool = True, progress: bool = True, lock_timeout: float | None = None,
                      log: Callable[[str], None] | None = None, quantize_device: str | torch.device | None = None
                      ) -> LayerCache:
        """The valid cache for this checkpoint and options, building (or rebuilding) it when needed.

        layers[i] names layer i's tensors (LayerNames); fmt in quant.FORMATS; dtype the compute dtype the
        layer's floating tensors are stored in (nf4/fp4/int8 dequantize to it). log(msg) receives one-line
        notices (stale/corrupt cache rebuilt, waiting for another builder); default: print to stderr.
        quantize_device: where a build quantizes ("cuda" is much faster than the CPU; default: CPU). int4 packs for
        that device's kernel, so pass the device the layers will run on."""
        log = log or _stderr
        check_format(fmt)
        checkpoint_dir = Path(checkpoint_dir).resolve()
        open_source(checkpoint_dir)          # CheckpointError for missing/truncated/pickle-only/unsupported weights
        options = options_of(checkpoint_dir, layers, fmt, dtype, double_quant, quantize_device)
        root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
        final = cache_dir_for(checkpoint_dir, options, root)
        expect = dict(options, fingerprint=fingerprint(checkpoint_dir))
        cache, problem = _try_open(final, verify, expect)
        if cache is not None:
            return cache
        if problem:
            log(f"{problem}; rebuilding it")
        with exclusive_lock(final.with_name(final.name + ".lock"), lock_timeout, log):
            cache, again = _try_open(final, verify, expect)          # built by another process while we waited?
            if cache is not None:
                return cache
            if again and not problem:
                log(f"{again}; rebuilding it")
            _build(checkpoint_dir, layers, final, expect, progress, log, quantize_device)
        return cls(final, _load_manifest(final), built=True)

    # -- facts

    @property
    def n_layers(self) -> int:
        return len(self.layouts)

    @property
    def fmt(self) -> str:
        return self.manifest["format"]

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    def layout(self, i: int) -> LayerLayout:
        return self.layouts[i]

    def nbytes(self, i: int) -> int:
        """Packed size of layer i (a multiple of storage.ALIGN)."""
        return self.layouts[i].nbytes

    def offset(self, i: int) -> int:
        """Byte offset of layer i in layers.bin (a multiple of storage.ALIGN)."""
        return int(self.manifest["layers"][i]["offset"])

    @property
    def max_nbytes(self) -> int:
        return max(self.nbytes(i) for i in range(self.n_layers))

    @property
    def total_nbytes(self) -> int:
        return int(self.manifest["file_nbytes"])

    @property
    def direct_io(self) -> bool:
        """Whether O_DIRECT reads are available for this file (else buffered reads + fadvise DONTNEED)."""
        return self._direct_fd is not None

    # -- reading

    def read_layer(self, i: int, out: torch.Tensor | None = None, direct: bool | None = None,
                   verify: bool = False) -> torch.Tensor:
        """Layer i's packed bytes: uint8 [nbytes(i)], a view of `out` (CPU, contiguous uint8, >= nbytes(i);
        pinned memory is fine) or of a new 4 KiB-aligned buffer.

        direct: None = O_DIRECT when the file allows it and `out` starts 4 KiB-aligned, else a buffered read
        followed by posix_fadvise(DONTNEED) so the page cache does not keep a second copy; True = O_DIRECT or
        CacheError; False = buffered. verify: check the sha256 (CacheCorruptError on mismatch)."""
        n = self.nbytes(i)
        buf = aligned_empty(n) if out is None else _check_out(out, n)[:n]
        fd = self._pick_fd(buf, direct)
        try:
            _pread_full(fd, buf, self.offset(i), self.file)
        except OSError as e:            # O_DIRECT opened but refused on read (some FUSE/network file systems)
            if fd != self._direct_fd or e.errno != errno.EINVAL or direct:
                raise
            os.close(self._direct_fd)
            self._direct_fd = None
            fd = self._fd
            _pread_full(fd, buf, self.offset(i), self.file)
        if fd != self._direct_fd:
            _drop_cached(fd, self.offset(i), n)
        if verify:
            self._check_sum(i, buf)
        return buf

    def _pick_fd(self, buf: torch.Tensor, direct: bool | None) -> int:
        aligned = buf.data_ptr() % ALIGN == 0
        if direct and (self._direct_fd is None or not aligned):
            why = "the file system refuses O_DIRECT" if self._direct_fd is None else "the buffer is not 4 KiB-aligned"
            raise CacheError(f"cannot read {self.file} with O_DIRECT: {why}")
        if direct is not False and self._direct_fd is not None and aligned:
            return self._direct_fd
        return self._fd

    # -- checking

    def _check_sum(self, i: int, buf: torch.Tensor) -> None:
        want = self.manifest["layers"][i]["sha256"]
        got = hashlib.sha256(buf.numpy()).hexdigest()
        if got != want:
            raise CacheCorruptError(f"{self.file}: layer {i} fails its checksum (sha256 {got[:12]}…, manifest "
                                    f"says {want[:12]}…); the cache is corrupt, delete {self.path} to rebuild it")

    def verify(self, i: int, buffer: torch.Tensor | None = None) -> None:
        """Read layer i and check its sha256; CacheCorruptError on mismatch."""
        self.read_layer(i, buffer, verify=True)

    def verify_all(self, memo: bool = False) -> None:
        """Check every layer's sha256 (one sequential pass, one buffer); with memo, skip a file already
        verified by this process (same device, inode, size and mtime) and remember a good one."""
        key = _file_key(self.file)
        if memo and key in _VERIFIED:
            return
        buf = aligned_empty(self.max_nbytes)
        for i in range(self.n_layers):
            self.verify(i, buf)
        _VERIFIED.add(key)

    def close(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._fd, self._direct_fd = -1, None

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            self.close()

    def __enter__(self) -> LayerCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"LayerCache({self.path}, {self.n_layers} layers, {self.fmt}, {self.dtype}, "
                f"{human_bytes(self.total_nbytes)})")


# ----------------------------------------------------------------------------------------- reading helpers

def aligned_empty(nbytes: int, align: int = ALIGN) -> torch.Tensor:
    """A CPU uint8 [nbytes] tensor whose data starts at a multiple of `align` (for O_DIRECT)."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    start = (-raw.data_ptr()) % align
    return raw[start:start + nbytes]


def _check_out(out: torch.Tensor, n: int) -> torch.Tensor:
    if out.device.type != "cpu" or out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"read_layer needs a contiguous 1-D uint8 CPU buffer, got {out.dtype} "
                         f"{list(out.shape)} on {out.device}")
    if out.numel() < n:
        raise ValueError(f"read_layer buffer holds {out.numel()} bytes, the layer has {n}")
    return out


def _open_direct(path: Path) -> int | None:
    """A second descriptor opened with O_DIRECT, or None where the platform or file system refuses it."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None


def _pread_full(fd: int, buf: torch.Tensor, offset: int, path: Path) -> None:
    """Fill buf (CPU uint8) from fd at offset, looping over short reads; CacheCorruptError at end of file."""
    view = memoryview(buf.numpy())
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise CacheCorruptError(f"{path} ends at byte {offset + done}, inside a layer; the cache is truncated "
                                    "(the next run rebuilds it)")
        done += got


def _drop_cached(fd: int, offset: int, n: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)


def _file_key(path: Path) -> tuple:
    st = path.stat()
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------- validation

def _load_manifest(path: Path) -> dict:
    """The manifest of cache dir `path`, checked for shape and against the file's size (no checksums)."""
    mpath, fpath = path / MANIFEST, path / LAYERS_FILE
    if not mpath.is_file() or not fpath.is_file():
        raise CacheError(f"{path} is not a layer cache (no {MANIFEST} or {LAYERS_FILE})")
    try:
        manifest = json.loads(mpath.read_text())
        layers = manifest["layers"]
        layouts = [LayerLayout.from_dict(e["layout"]) for e in layers]
        offsets = [int(e["offset"]) for e in layers]
        size = int(manifest["file_nbytes"])
        _ = [str(e["sha256"]) for e in layers]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CacheCorruptError(f"{mpath} is not a valid manifest ({type(e).__name__}: {e})") from None
    if manifest.get("version") != VERSION:
        raise CacheError(f"{path} was written by cache version {manifest.get('version')}, this is {VERSION}")
    expected = 0
    for i, (off, lay) in enumerate(zip(offsets, layouts)):
        if off != expected or off % ALIGN:
            raise CacheCorruptError(f"{mpath}: layer {i} at offset {off}, expected {expected}")
        expected = off + lay.nbytes
    actual = fpath.stat().st_size
    if expected != size or actual != size:
        raise CacheCorruptError(f"{fpath} has {actual} bytes, the manifest expects {size} (layers end at {expected}); "
                                "the cache is truncated or overwritten")
    return manifest


def _check_expected(path: Path, manifest: dict, expect: dict) -> None:
    """CacheError when the manifest was built from other source files or with other options (stale)."""
    for key, want in expect.items():
        if manifest.get(key) != want:
            what = "the checkpoint's files changed" if key == "fingerprint" else f"its {key} differs"
            raise CacheError(f"{path} is stale: {what} since it was built")


def _try_open(final: Path, verify: bool, expect: dict) -> tuple[LayerCache | None, str | None]:
    """(the cache at `final`, None) if it is valid; (None, why not) if it is unusable; (None, None) if absent."""
    if not final.exists():
        return None, None
    try:
        return LayerCache.open(final, verify=verify, expect=expect), None
    except (CacheError, OSError) as e:              # OSError: removed while we opened it (a rebuild elsewhere)
        return None, str(e)


# ----------------------------------------------------------------------------------------- building

def plan(checkpoint_dir: Path, layers: Sequence[LayerNames], fmt: str, dtype: torch.dtype, double_quant: bool,
         device: str | torch.device | None = None) -> list[LayerLayout]:
    """Every layer's packed layout when quantized on `device` (default CPU), from the safetensors headers alone
    (nothing is read or quantized)."""
    src = source_specs(checkpoint_dir)
    layouts = []
    for i, s in enumerate(layers):
        missing = [c for c in s.tensors.values() if c not in src]
        if missing:
            raise CacheError(f"{checkpoint_dir}: layer {i} needs tensor {missing[0]!r}, which no weight file has")
        specs, meta = layer_specs({p: src[c] for p, c in s.tensors.items()}, fmt, dtype, s.linear, double_quant,
                                  device or "cpu")
        layouts.append(plan_layout(specs, meta))
    return layouts


def _build(checkpoint_dir: Path, layers: Sequence[LayerNames], final: Path, expect: dict, progress: bool,
           log: Callable[[str], None], device: str | torch.device | None = None) -> None:
    """Quantize every layer into a temporary directory next to `final`, then rename it there (lock held)."""
    dtype = getattr(torch, expect["dtype"])
    layouts = plan(checkpoint_dir, layers, expect["format"], dtype, expect["double_quant"], device)
    _remove_leftovers(final)
    total = sum(lay.nbytes for lay in layouts)
    check_free_space(final.parent, total + SPACE_MARGIN)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        entries = _write_layers(tmp / LAYERS_FILE, checkpoint_dir, layers, layouts, expect, progress, device)
        manifest = dict(expect, file=LAYERS_FILE, file_nbytes=total, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        layers=entries)
        _write_json(tmp / MANIFEST, manifest)
        _fsync_dir(tmp)
        _replace_dir(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CacheError(f"disk full while writing the layer cache in {final.parent} (needs "
                             f"{human_bytes(total)}); nothing was kept — free space or set SPECEXEC_CACHE") from None
        if e.errno == errno.EFBIG:          # RLIMIT_FSIZE (ulimit -f; SIGXFSZ is ignored by Python) or the fs's limit
            raise CacheError(f"cannot write the layer cache in {final.parent}: {human_bytes(total)} exceeds the "
                             "largest file this process may write (ulimit -f, or the file system's limit); nothing "
                             "was kept — raise the limit, or point SPECEXEC_CACHE (or --out) at another file "
                             "system") from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _VERIFIED.add(_file_key(final / LAYERS_FILE))


def check_free_space(directory: Path, needed: int) -> None:
    """CacheError naming needed vs free bytes when `directory`'s file system cannot hold `needed` more."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise CacheError(f"not enough disk space for the layer cache in {directory}: needs {human_bytes(needed)}, "
                         f"{human_bytes(free)} free; free some space or point SPECEXEC_CACHE (or --out) elsewhere")


def _remove_leftovers(final: Path) -> None:
    """Remove temporary dirs of dead builders and the invalid cache itself (lock held, so nobody writes)."""
    for p in final.parent.glob(f".{final.name}.*"):
        shutil.rmtree(p, ignore_errors=True)
    if final.exists():                     # stale or corrupt (else _try_open would have returned it)
        shutil.rmtree(final)


def _write_layers(path: Path, checkpoint_dir: Path, layers: Sequence[LayerNames], layouts: list[LayerLayout],
                  expect: dict, progress: bool, device: str | torch.device | None = None) -> list[dict]:
    """Quantize, pack and write every layer at its aligned offset; returns the manifest's layer entries."""
    ckpt = open_source(checkpoint_dir)
    dtype = getattr(torch, expect["dtype"])
    entries, offset = [], 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with _progress_bar(progress, len(layers), f"quantizing to {expect['format']}") as advance:
            for i, (source, planned) in enumerate(zip(layers, layouts)):
                buf, layout = _quantize_layer(ckpt, source, expect["format"], dtype, expect["double_quant"], device)
                if layout != planned:
                    raise RuntimeError(f"layer {i}: packed layout differs from the planned one")
                _write_layer(fd, buf, offset)
                entries.append({"offset": offset, "nbytes": layout.nbytes,
                                "sha256": hashlib.sha256(buf.numpy()).hexdigest(), "layout": layout.to_dict()})
                offset += layout.nbytes
                del buf
                advance()
        os.fsync(fd)
    finally:
        os.close(fd)
    return entries


def _quantize_layer(ckpt: CheckpointSource, source: LayerNames, fmt: str, dtype: torch.dtype,
                    double_quant: bool, device: str | torch.device | None = None) -> tuple[torch.Tensor, LayerLayout]:
    """One layer read from the checkpoint, quantized (on `device`, default CPU) and packed: (uint8 [nbytes], layout)."""
    tensors = {packed: ckpt.get(name).to(device or "cpu") for packed, name in source.tensors.items()}
    qtensors, meta = quantize_tensors(tensors, fmt, dtype, source.linear, double_quant)
    return pack_layer(qtensors, meta)


def _write_layer(fd: int, buf: torch.Tensor, offset: int) -> None:
    """Write one packed layer at `offset` (loops over short writes)."""
    view = memoryview(buf.numpy())
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Atomically publish tmp as final (final does not exist: _remove_leftovers removed an invalid one)."""
    os.rename(tmp, final)
    _fsync_dir(final.parent)


@contextmanager
def _progress_bar(enabled: bool, total: int, what: str) -> Iterator[Callable[[], None]]:
    """A rich progress bar on stderr (layers done / total, ETA); yields advance()."""
    if not enabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("layers"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)
