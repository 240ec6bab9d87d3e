"""On-disk cache of quantized, packed decoder layers for one checkpoint + quantization format + dtype.

One directory per (checkpoint path, format, dtype, double quant, packing, layer naming) under the cache root
($SPECEXEC_CACHE, else $XDG_CACHE_HOME/specexec, else ~/.cache/specexec) holds:
  layers.bin     every layer packed by offload.streaming.storage, each at a 4 KiB-aligned offset and padded to 4 KiB, so
                 it can be read with O_DIRECT straight into aligned (pinned) buffers
  manifest.json  version, source fingerprint (name, size, mtime and header hash of config.json, the index and
                 every safetensors file, and each weight file's sampled digest: 64 blocks of its bytes, so weights
                 swapped under the same size and mtime are seen), format, dtype, and per layer: offset, nbytes, sha256, packed layout
                 (with its named regions: a sub-region, e.g. one expert, starts 4 KiB-aligned at file offset
                 + region offset and can be read with O_DIRECT alone)

Building (LayerCache.open_or_build): under an exclusive lock on "<root>/.locks/<dir>.lock" (offload/cache/locking.py: flock or the
platform's stand-in; a lock left by a dead process never blocks), quantize layer by layer from the checkpoint
(peak RAM about one layer), write into a temporary directory next to the final one, fsync, rename. Free space
is checked first. A second process waits for the lock, then reuses what the first built. The next layer is read
and quantized on a thread while the last is hashed and written. An error removes the temporary directory (a disk
that fills up or a file-size limit (EFBIG: ulimit -f) part-way is a one-line CacheError); an interrupt (Ctrl-C,
the CLI's SIGTERM) or a kill leaves it, and the next builder resumes it from its journal (journal.py: only the
layers it lacks are converted) or removes it when it was another build's.

Trust: every open checks the manifest, the version, the source fingerprint, the build options and the exact
file size (cache_manifest.py; a stale, truncated, garbled or marked-corrupt cache is rebuilt with a message,
never used) and reads no layer. Each layer's sha256 is checked the first time this process reads it
(cache_reading.py: the RAM/resident tiers when they are filled, a streamed layer in the read-ahead thread); a
mismatch is one CacheCorruptError line and marks the cache so the next open rebuilds it. verify=True (or
`specexec convert --verify`) checks every layer at once.

Split by job: identity.py (fingerprints, options, directory names), manifest.py (errors, checks made at open),
reading.py (reads, checksums), layouts.py (layouts and input bytes from headers), journal.py (resuming),
locking.py; this module opens and builds. Their public
names are importable from here.

Does not know: models or architectures. The caller names, per layer, which checkpoint tensors make it up (under
the names the runtime binds them by) and which of them are linear weights to quantize (LayerNames).

CONTRACT (used by specexec/runtime/offloaded.py, offload/streaming/tiers.py's SSD tier and cli/convert.py):

    @dataclass(frozen=True)
    class LayerNames:
        tensors: Mapping[str, str | TensorRef]   # packed name (module-local, e.g. "mlp.up_proj.weight") -> source
        linear: frozenset[str]           # packed names of the nn.Linear weights to quantize
        regions: tuple[str, ...] = ()    # packed-name prefixes each packed as its own aligned region (experts)

    class LayerCache:
        @classmethod
        def open_or_build(cls, checkpoint_dir, layers: Sequence[LayerNames], fmt: str, dtype: torch.dtype, *,
                          cache_root=None, double_quant=False, verify=False, progress=True, lock_timeout=None,
                          log=None, quantize_device=None, on_layer=None, search=None) -> LayerCache
        @classmethod
        def open(cls, path, verify=False, expect=None) -> LayerCache     # an existing cache dir, or CacheError
        path: Path (the cache dir); file: Path (layers.bin); built: bool (this call built it); manifest: dict
        n_layers, fmt, dtype (str), max_nbytes, total_nbytes, direct_io
        layout(i) -> storage.LayerLayout (meta = quant meta for quant.bind_module); nbytes(i); offset(i)
        read_layer(i, out=None, direct=None, verify=None) -> uint8 [nbytes(i)] (a view of out when given;
            verify None: check the sha256 on this process's first read of layer i)
        verify(i, buffer=None); verify_all(memo=False, progress=False) -> bytes read; close(); context manager

    class CacheError(ValueError); class CacheCorruptError(CacheError)    # one-line messages; CLI exit 2
    default_cache_root() -> Path; aligned_empty(nbytes) -> uint8 tensor at a 4 KiB boundary
    plan(checkpoint_dir, layers, fmt, dtype, double_quant, device=None) -> list[LayerLayout]   # from headers only
    (offload/cache/packed.py) write_packed(directory, [(packed uint8, layout)], options) -> LayerCache
        # made-up layers (benchmarks)
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from cpu_kernels.cache_root import default_cache_root
from offload.cache.identity import LayerNames, cache_dir_for, fingerprint, options_of
from offload.memory_plan import gb_text
from offload.cache.manifest import (LAYERS_FILE, MANIFEST, CacheError, check_expected, load_manifest,
                                    mark_corrupt)
from offload.cache.reading import LayerFile
from offload.platform.facilities import fsync_dir, pwrite_all
from offload.cache import journal
from offload.cache.layouts import plan, source_nbytes
from offload.cache.locking import exclusive_lock as _exclusive_lock
from offload.cache.progress import progress_bar
from offload.formats.refs import read_ref
from offload.formats.sources import CheckpointSource, open_source
from offload.quant.weights import check_format, quantize_tensors
from offload.streaming.storage import LayerLayout, pack_layer

SPACE_MARGIN = 64 << 20            # bytes kept free beyond the cache itself (manifest, filesystem slack)


def exclusive_lock(lock_path: Path, timeout: float | None = None, log: Callable[[str], None] | None = None):
    """locking.exclusive_lock raising CacheError on timeout (one line naming the lock file)."""
    return _exclusive_lock(lock_path, timeout, log, CacheError)


LOCKS = ".locks"              # the build locks' folder under the cache root (none beside the caches themselves)


def lock_path(final: Path) -> Path:
    """The build lock of the cache directory `final`: <root>/.locks/<name>.lock (its folder made here). A lock
    file is never removed (a waiter may hold it open), so they live apart from the caches a user lists."""
    folder = final.parent / LOCKS
    folder.mkdir(parents=True, exist_ok=True)
    return folder / (final.name + ".lock")


class LayerCache:
    """An opened, validated cache: layout(i), nbytes(i), offset(i), read_layer(i, out), verify(i).

    Reads are positional (facilities.pread_into), so one LayerCache may be read from several threads at once."""

    def __init__(self, path: Path, manifest: dict, built: bool = False) -> None:
        self.path = Path(path)                          # the cache directory
        self.file = self.path / LAYERS_FILE
        self.manifest = manifest
        self.built = built                              # True when this call built it (tests, messages)
        self.layouts = [LayerLayout.from_dict(e["layout"]) for e in manifest["layers"]]
        entries = manifest["layers"]
        self._file = LayerFile(self.file, [int(e["offset"]) for e in entries], [lay.nbytes for lay in self.layouts],
                               [str(e["sha256"]) for e in entries], lambda why: mark_corrupt(self.path, why),
                               [[(0, lay.dense_nbytes)] * bool(lay.regions) + [(r.offset, r.nbytes) for r in lay.regions]
                                for lay in self.layouts],
                               [[str(h) for h in e.get("region_sha256") or ()] for e in entries])

    # -- opening

    @classmethod
    def open(cls, path: str | os.PathLike, verify: bool = False, expect: dict | None = None) -> LayerCache:
        """Open the cache directory `path`; CacheError/CacheCorruptError if it is unusable. Reads no layer
        unless verify=True (every layer's sha256 checked now, once per process and file).

        expect: the options (options_of) and "fingerprint" it must have been built for, if any."""
        path = Path(path)
        manifest = load_manifest(path)
        if expect is not None:
            check_expected(path, manifest, expect)
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
                      verify: bool = False, progress: bool = True, lock_timeout: float | None = None,
                      log: Callable[[str], None] | None = None, quantize_device: str | torch.device | None = None,
                      on_layer: Callable[[int, int], None] | None = None, search: str | None = None) -> LayerCache:
        """The valid cache for this checkpoint and options, building (or rebuilding) it when needed.

        layers[i] names layer i's tensors (LayerNames); fmt in quant.FORMATS; dtype the compute dtype the
        layer's floating tensors are stored in (nf4/fp4/int8 dequantize to it). log(msg) receives one-line
        notices (stale/corrupt cache rebuilt, waiting for another builder); default: print to stderr.
        verify: also check every layer's sha256 now (default: each on its first read).
        quantize_device: where a build quantizes ("cuda" is much faster than the CPU; default: CPU). int4 packs for
        that device's kernel, so pass the device the layers will run on. on_layer(done, total): called after each
        layer a build writes (a caller's own progress display; progress=False turns the bar here off).
        search: int4's range search (offload/quant/int4.SEARCHES), recorded in the manifest: None takes a cache
        built with any search and builds with "default"; a name rebuilds a cache built with another one.
        A build killed or interrupted part-way leaves its temporary directory; the next build of the same cache
        resumes it (offload/cache/journal.py), converting only the layers it lacks."""
        log = log or _stderr
        check_format(fmt)
        checkpoint_dir = Path(checkpoint_dir).resolve()
        open_source(checkpoint_dir)          # CheckpointError for missing/truncated/pickle-only/unsupported weights
        options = options_of(checkpoint_dir, layers, fmt, dtype, double_quant, quantize_device)
        root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
        final = cache_dir_for(checkpoint_dir, options, root)
        expect = dict(options, fingerprint=fingerprint(checkpoint_dir))
        cache, problem = _try_open(final, verify, expect, search)
        if cache is not None:
            return cache
        if problem:
            log(f"{problem}; rebuilding it")
        with exclusive_lock(lock_path(final), lock_timeout, log):
            cache, again = _try_open(final, verify, expect, search)  # built by another process while we waited?
            if cache is not None:
                return cache
            if again and not problem:
                log(f"{again}; rebuilding it")
            _build(checkpoint_dir, layers, final, expect, progress, log, quantize_device, on_layer, search or "default")
        cache = cls(final, load_manifest(final), built=True)
        cache._file.mark_verified()                  # the sums came from the bytes just written
        return cache

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
        return self._file.direct_io

    # -- reading

    def read_layer(self, i: int, out: torch.Tensor | None = None, direct: bool | None = None,
                   verify: bool | None = None) -> torch.Tensor:
        """Layer i's packed bytes: uint8 [nbytes(i)], a view of `out` (CPU, contiguous uint8, >= nbytes(i);
        pinned memory is fine) or of a new 4 KiB-aligned buffer.

        direct: None = O_DIRECT when the file allows it and `out` starts 4 KiB-aligned, else a buffered read
        followed by posix_fadvise(DONTNEED) so the page cache does not keep a second copy; True = O_DIRECT or
        CacheError; False = buffered. verify: check the sha256 (CacheCorruptError on mismatch, and the cache is
        marked for rebuilding): None = on this process's first read of layer i, True = always, False = never."""
        return self._file.read(i, out, direct, verify)

    def read_region(self, i: int, name: str, out: torch.Tensor | None = None, direct: bool | None = None,
                    verify: bool | None = None) -> torch.Tensor:
        """Region `name` of layer i alone (storage.Region: e.g. one expert), uint8 [its nbytes], into `out` as
        read_layer (O_DIRECT when `out` is 4 KiB-aligned: the region starts and ends on 4 KiB); verify checks
        the region's own sha256, on this process's first read of it by default."""
        lay = self.layouts[i]
        try:
            r = lay.region(name)
        except KeyError:
            raise KeyError(f"layer {i} of {self.path} has no region {name!r}") from None
        return self._file.read_region(i, lay.part_index(r.offset, r.nbytes), out, direct, verify)  # 0: dense

    def read_part(self, i: int, offset: int, out: torch.Tensor) -> None:
        """(the SSD tier's LayerReader.read_part) Layer i's dense part (offset 0, its nbytes) or one region (its
        offset and nbytes) into `out`, checked against its own sha256 on its first read here; ValueError for
        any other range."""
        k = self.layouts[i].part_index(offset, out.numel())            # a dict: E experts read in O(E), not E^2
        if k is None:
            raise ValueError(f"bytes [{offset}, {offset + out.numel()}) of layer {i} are not one of its parts")
        self._file.read_region(i, k, out)

    def verify(self, i: int, buffer: torch.Tensor | None = None) -> None:
        """Read layer i and check its sha256; CacheCorruptError on mismatch."""
        self.read_layer(i, buffer, verify=True)

    def verify_all(self, memo: bool = False, progress: bool = False) -> int:
        """Check every layer's sha256 (one sequential pass, one buffer; a rich bar on stderr with progress);
        with memo, skip layers this process already checked. Returns the bytes read."""
        return self._file.verify_all(memo, progress)

    def close(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> LayerCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"LayerCache({self.path}, {self.n_layers} layers, {self.fmt}, {self.dtype}, "
                f"{gb_text(self.total_nbytes)})")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _try_open(final: Path, verify: bool, expect: dict, search: str | None = None
              ) -> tuple[LayerCache | None, str | None]:
    """(the cache at `final`, None) if it is valid (and built with `search`, when named); (None, why not) if it is
    unusable; (None, None) if absent."""
    if not final.exists():
        return None, None
    try:
        cache = LayerCache.open(final, verify=verify, expect=expect)
    except (CacheError, OSError) as e:              # OSError: removed while we opened it (a rebuild elsewhere)
        return None, str(e)
    built_with = cache.manifest.get("search", "default")
    if search is not None and built_with != search:
        cache.close()
        return None, f"{final} was built with the {built_with} int4 search, not {search}"
    return cache, None


# ----------------------------------------------------------------------------------------- building

def _build(checkpoint_dir: Path, layers: Sequence[LayerNames], final: Path, expect: dict, progress: bool,
           log: Callable[[str], None], device: str | torch.device | None = None,
           on_layer: Callable[[int, int], None] | None = None, search: str = "default") -> None:
    """Quantize every layer into a temporary directory next to `final` (resuming one a dead or interrupted build
    left: journal.py), then rename it there (lock held). An error removes the directory; an interrupt
    (KeyboardInterrupt, the CLI's SIGTERM: not an Exception) keeps it for the next build to resume."""
    dtype = getattr(torch, expect["dtype"])
    layouts = plan(checkpoint_dir, layers, expect["format"], dtype, expect["double_quant"], device)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    built = dict(expect, search=search)
    resumed = journal.adopt(final, tmp, built)
    _remove_leftovers(final, keep=tmp)
    total = sum(lay.nbytes for lay in layouts)
    if not resumed:
        check_free_space(final.parent, total + SPACE_MARGIN)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        entries = _write_layers(tmp, checkpoint_dir, layers, layouts, built, progress, device, on_layer, log)
        manifest = dict(built, file=LAYERS_FILE, file_nbytes=total, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        layers=entries)
        _write_json(tmp / MANIFEST, manifest)
        (tmp / journal.JOURNAL).unlink()
        fsync_dir(tmp)
        _replace_dir(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CacheError(f"disk full while writing the layer cache in {final.parent} (needs "
                             f"{gb_text(total)}); nothing was kept — free space or set SPECEXEC_CACHE") from None
        if e.errno == errno.EFBIG:          # RLIMIT_FSIZE (ulimit -f; SIGXFSZ is ignored by Python) or the fs's limit
            raise CacheError(f"cannot write the layer cache in {final.parent}: {gb_text(total)} exceeds the "
                             "largest file this process may write (ulimit -f, or the file system's limit); nothing "
                             "was kept — raise the limit, or point SPECEXEC_CACHE (or --out) at another file "
                             "system") from None
        raise
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_free_space(directory: Path, needed: int) -> None:
    """CacheError naming needed vs free bytes when `directory`'s file system cannot hold `needed` more."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise CacheError(f"not enough disk space for the layer cache in {directory}: needs {gb_text(needed)}, "
                         f"{gb_text(free)} free; free some space or point SPECEXEC_CACHE (or --out) elsewhere")


def _remove_leftovers(final: Path, keep: Path | None = None) -> None:
    """Remove temporary dirs of dead builders but `keep` (an adopted one), and the invalid cache itself (lock
    held, so nobody writes)."""
    for p in final.parent.glob(f".{final.name}.*"):
        if p != keep:
            shutil.rmtree(p, ignore_errors=True)
    if final.exists():                     # stale or corrupt (else _try_open would have returned it)
        shutil.rmtree(final)


def _write_layers(tmp: Path, checkpoint_dir: Path, layers: Sequence[LayerNames], layouts: list[LayerLayout],
                  built: dict, progress: bool, device: str | torch.device | None = None,
                  on_layer: Callable[[int, int], None] | None = None,
                  log: Callable[[str], None] = lambda _m: None) -> list[dict]:
    """Quantize, pack and write every layer at its aligned offset into tmp/layers.bin, journaling each; the layers
    an adopted build's journal vouches for are kept. Returns the manifest's layer entries."""
    ckpt = open_source(checkpoint_dir)
    dtype = getattr(torch, built["dtype"])
    book = journal.Journal(tmp, built)
    fd = os.open(tmp / LAYERS_FILE, os.O_RDWR | os.O_CREAT | getattr(os, "O_BINARY", 0), 0o644)
    ahead = None
    try:
        entries = journal.kept_layers(fd, journal.read_entries(tmp, built), layouts)
        if entries:
            log(f"resuming an interrupted build: {len(entries)} of {len(layers)} layers already converted")
        book.start(entries)
        offset = sum(lay.nbytes for lay in layouts[:len(entries)])
        sizes = source_nbytes(checkpoint_dir, layers)
        todo = range(len(entries), len(layers))
        ahead = ThreadPoolExecutor(1, thread_name_prefix="quantize-ahead")

        def quantized(i: int) -> Future | None:
            return ahead.submit(_quantize_layer, ckpt, layers[i], built["format"], dtype, built["double_quant"],
                                device, built.get("search", "default")) if i < len(layers) else None

        with progress_bar(progress, len(layers), f"quantizing to {built['format']}", sizes=sizes,
                          done=len(entries)) as advance:
            nxt = quantized(todo.start)
            for i in todo:                 # layer i+1 is read and quantized while layer i is hashed and written
                buf, layout = nxt.result()
                nxt = quantized(i + 1)
                if layout != layouts[i]:
                    raise RuntimeError(f"layer {i}: packed layout differs from the planned one")
                entries.append(_write_entry(fd, buf, layout, offset))
                book.add(entries[-1])
                offset += layout.nbytes
                del buf
                advance()
                if on_layer is not None:
                    on_layer(i + 1, len(layers))
        os.ftruncate(fd, offset)
        os.fsync(fd)
    finally:
        if ahead is not None:
            ahead.shutdown(wait=False, cancel_futures=True)
        book.close()
        os.close(fd)
    return entries


def _write_entry(fd: int, buf: torch.Tensor, layout: LayerLayout, offset: int) -> dict:
    """Write one packed layer at `offset`; its manifest entry (offset, size, sha256s, layout)."""
    _write_layer(fd, buf, offset)
    entry = {"offset": offset, "nbytes": layout.nbytes, "sha256": hashlib.sha256(buf.numpy()).hexdigest(),
             "layout": layout.to_dict()}
    if layout.regions:                    # the dense part and each region checked alone when read alone
        parts = [(0, layout.dense_nbytes)] + [(r.offset, r.nbytes) for r in layout.regions]
        entry["region_sha256"] = [hashlib.sha256(buf[o:o + n].numpy()).hexdigest() for o, n in parts]
    return entry


def _quantize_layer(ckpt: CheckpointSource, source: LayerNames, fmt: str, dtype: torch.dtype,
                    double_quant: bool, device: str | torch.device | None = None, search: str = "default"
                    ) -> tuple[torch.Tensor, LayerLayout]:
    """One layer read from the checkpoint, quantized (on `device`, default CPU) and packed: (uint8 [nbytes], layout)."""
    tensors = {packed: read_ref(ckpt, ref).to(device or "cpu") for packed, ref in source.refs().items()}
    qtensors, meta = quantize_tensors(tensors, fmt, dtype, source.linear, double_quant, search)
    return pack_layer(qtensors, meta, source.regions)


def _write_layer(fd: int, buf: torch.Tensor, offset: int) -> None:
    """Write one packed layer at `offset` (loops over short writes)."""
    pwrite_all(fd, memoryview(buf.numpy()), offset)


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _replace_dir(tmp: Path, final: Path) -> None:
    """Atomically publish tmp as final (final does not exist: _remove_leftovers removed an invalid one)."""
    os.rename(tmp, final)
    fsync_dir(final.parent)
