"""Reading a layer cache's layers.bin: positional reads (O_DIRECT when the file system allows it), each layer's
sha256 checked the first time this process reads it, and a full check on request.

Reads are positional (facilities.pread_into: os.preadv, or its stand-in) on one descriptor per mode, so several
threads may read at once; where the platform has no O_DIRECT (facilities.open_unbuffered) every read is buffered
and its pages dropped from the page cache where posix_fadvise exists. A layer's checksum is
checked on its first read in this process (memoized by the file's device, inode, size and mtime, and the
layer), so startup reads nothing and a streamed layer is checked by the read-ahead thread that first reads
it; a mismatch is a one-line CacheCorruptError and the cache is marked for rebuilding (cache_manifest).
`verify_all` reads and checks every layer (`specexec convert --verify`).

Does not know: what the bytes mean (storage.py), the manifest's structure beyond offsets, sizes and sums.
"""
from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from offload.cache.manifest import CacheCorruptError, CacheError
from offload.platform import facilities
from offload.cache.progress import progress_bar
from offload.streaming.storage import ALIGN

_VERIFIED: set[tuple] = set()      # (realpath, st_dev, st_ino, st_size, st_mtime_ns, layer) checked in this process


class LayerFile:
    """layers.bin of one cache: layer i is sizes[i] bytes at offsets[i] with sha256 sums[i]."""

    def __init__(self, file: Path, offsets: Sequence[int], sizes: Sequence[int], sums: Sequence[str],
                 on_corrupt: Callable[[str], None] | None = None,
                 regions: Sequence[Sequence[tuple[int, int]]] = (), region_sums: Sequence[Sequence[str]] = ()
                 ) -> None:
        """regions[i]: (offset inside the layer, nbytes) of layer i's parts read alone (its dense part, then its
        named sub-regions); region_sums[i] their sha256 sums (a part read alone is checked against its own)."""
        self.file, self.offsets, self.sizes, self.sums = Path(file), list(offsets), list(sizes), list(sums)
        self.regions, self.region_sums = [list(r) for r in regions], [list(s) for s in region_sums]
        self.on_corrupt = on_corrupt
        self._fd = facilities.open_read(self.file)
        self._direct_fd: int | None = facilities.open_unbuffered(self.file)
        self.key = file_key(self._fd, self.file)

    @property
    def direct_io(self) -> bool:
        return self._direct_fd is not None

    def read(self, i: int, out: torch.Tensor | None = None, direct: bool | None = None,
             verify: bool | None = None) -> torch.Tensor:
        """Layer i into `out` (see LayerCache.read_layer); verify None = only on its first read here."""
        n = self.sizes[i]
        buf = aligned_empty(n) if out is None else _check_out(out, n)[:n]
        self._read_at(buf, self.offsets[i], direct)
        if verify or (verify is None and self.key + (i,) not in _VERIFIED):
            self.check(i, buf)
        return buf

    def _read_at(self, buf: torch.Tensor, offset: int, direct: bool | None) -> None:
        """Fill buf from the file at `offset`: O_DIRECT where it may (see _pick_fd), falling back to a buffered
        read whose pages are dropped when the file system refuses O_DIRECT on read (some FUSE/network ones)."""
        fd = self._pick_fd(buf, direct)
        try:
            _pread_full(fd, buf, offset, self.file)
        except OSError as e:
            if fd != self._direct_fd or e.errno != errno.EINVAL or direct:
                raise
            os.close(self._direct_fd)
            self._direct_fd = None
            fd = self._fd
            _pread_full(fd, buf, offset, self.file)
        if fd != self._direct_fd:
            facilities.drop_cached(fd, offset, buf.numel())

    def read_region(self, i: int, k: int, out: torch.Tensor | None = None, direct: bool | None = None,
                    verify: bool | None = None) -> torch.Tensor:
        """Region k of layer i alone (see LayerCache.read_region); checked against its own sha256 unless the
        whole layer was checked here before."""
        start, n = self.regions[i][k]
        buf = aligned_empty(n) if out is None else _check_out(out, n)[:n]
        self._read_at(buf, self.offsets[i] + start, direct)
        known = self.key + (i,) in _VERIFIED or self.key + (i, k) in _VERIFIED
        if verify or (verify is None and not known):
            self._check_region(i, k, buf)
        return buf

    def _check_region(self, i: int, k: int, buf: torch.Tensor) -> None:
        want = self.region_sums[i][k] if i < len(self.region_sums) and k < len(self.region_sums[i]) else None
        got = hashlib.sha256(buf.numpy()).hexdigest()
        if want is None or got != want:
            why = (f"layer {i} part {k} fails its checksum (sha256 {got[:12]}…, manifest says "
                   f"{(want or 'nothing')[:12]}…)")
            if self.on_corrupt is not None:
                self.on_corrupt(why)
            raise CacheCorruptError(f"{self.file}: {why}; the cache is corrupt (the next run rebuilds it)")
        _VERIFIED.add(self.key + (i, k))

    def _pick_fd(self, buf: torch.Tensor, direct: bool | None) -> int:
        aligned = buf.data_ptr() % ALIGN == 0
        if direct and (self._direct_fd is None or not aligned):
            why = "the file system refuses O_DIRECT" if self._direct_fd is None else "the buffer is not 4 KiB-aligned"
            raise CacheError(f"cannot read {self.file} with O_DIRECT: {why}")
        if direct is not False and self._direct_fd is not None and aligned:
            return self._direct_fd
        return self._fd

    def check(self, i: int, buf: torch.Tensor) -> None:
        """CacheCorruptError (and the cache marked for rebuilding) unless buf holds layer i's bytes."""
        got = hashlib.sha256(buf.numpy()).hexdigest()
        if got != self.sums[i]:
            why = f"layer {i} fails its checksum (sha256 {got[:12]}…, manifest says {self.sums[i][:12]}…)"
            if self.on_corrupt is not None:
                self.on_corrupt(why)
            raise CacheCorruptError(f"{self.file}: {why}; the cache is corrupt (the next run rebuilds it)")
        _VERIFIED.add(self.key + (i,))

    def verify_all(self, memo: bool = False, progress: bool = False) -> int:
        """Read and check every layer (one buffer, in file order); memo: skip layers this process already
        checked. Returns the bytes read."""
        todo = [i for i in range(len(self.sizes)) if not (memo and self.key + (i,) in _VERIFIED)]
        buf = aligned_empty(max(self.sizes, default=0))
        with progress_bar(progress, len(todo), "verifying") as advance:
            for i in todo:
                self.read(i, buf, verify=True)
                advance()
        return sum(self.sizes[i] for i in todo)

    def mark_verified(self) -> None:
        """Every layer counts as checked (right after a build: the sums came from the bytes written)."""
        _VERIFIED.update(self.key + (i,) for i in range(len(self.sizes)))

    def close(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._fd, self._direct_fd = -1, None


def aligned_empty(nbytes: int, align: int = ALIGN) -> torch.Tensor:
    """A CPU uint8 [nbytes] tensor whose data starts at a multiple of `align` (for O_DIRECT)."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    start = (-raw.data_ptr()) % align
    return raw[start:start + nbytes]


def file_key(fd: int, path: Path) -> tuple:
    """What identifies the file's bytes for the memo: real path, device, inode, size, mtime."""
    st = os.fstat(fd)
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _check_out(out: torch.Tensor, n: int) -> torch.Tensor:
    if out.device.type != "cpu" or out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(f"read_layer needs a contiguous 1-D uint8 CPU buffer, got {out.dtype} "
                         f"{list(out.shape)} on {out.device}")
    if out.numel() < n:
        raise ValueError(f"read_layer buffer holds {out.numel()} bytes, the layer has {n}")
    return out


def _pread_full(fd: int, buf: torch.Tensor, offset: int, path: Path) -> None:
    """Fill buf (CPU uint8) from fd at offset, looping over short reads; CacheCorruptError at end of file."""
    view = memoryview(buf.numpy())
    done = 0
    while done < len(view):
        got = facilities.pread_into(fd, view[done:], offset + done)
        if got == 0:
            raise CacheCorruptError(f"{path} ends at byte {offset + done}, inside a layer; the cache is truncated "
                                    "(the next run rebuilds it)")
        done += got

