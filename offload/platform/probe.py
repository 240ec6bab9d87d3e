"""Bandwidth probes of a machine, for `specexec doctor`: host -> GPU copies (pinned and pageable, timed with
CUDA events on the stream that copies) and a disk's sequential read with O_DIRECT (the page cache cannot
answer it: a file is written, read back from the device, and removed).

Does not know: models, layers, plans; what the figures are used for.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import time
from pathlib import Path

import torch

from offload.platform.facilities import drop_cached, open_read, open_unbuffered, pread_into

ALIGN = 4096                      # O_DIRECT wants buffer, offset and length aligned to the logical block size
CHUNK = 8 << 20                   # bytes per read() call


def h2d_gbps(nbytes: int, pinned: bool, device: torch.device | str = "cuda", repeats: int = 3) -> float:
    """GB/s of the best of `repeats` copies of `nbytes` host bytes (pinned or pageable) to `device`, timed
    with CUDA events on the current stream."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=pinned)                      # warm-up (and page in the pageable buffer)
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=pinned)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return nbytes / best / 1e9


def _aligned(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer (mmap is always page-aligned)."""
    return mmap.mmap(-1, nbytes)


def direct_read_gbps(directory: str | os.PathLike, nbytes: int) -> tuple[float, bool]:
    """(GB/s, whether O_DIRECT was used) of reading a fresh `nbytes` file in `directory` sequentially. The
    file is written and fsynced, its page cache dropped, read back (with O_DIRECT where the filesystem allows
    it, else a buffered read after posix_fadvise DONTNEED), then removed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = max(ALIGN, nbytes // ALIGN * ALIGN)
    fd, name = tempfile.mkstemp(prefix=".specexec-doctor-", dir=directory)
    try:
        block = os.urandom(1 << 20) * (CHUNK >> 20)
        left = nbytes
        while left:
            left -= os.write(fd, block[:min(left, len(block))])
        os.fsync(fd)
        drop_cached(fd, 0, nbytes)
        os.close(fd)
        fd = -1
        return _timed_read(name, nbytes)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(name)


def _timed_read(name: str, nbytes: int) -> tuple[float, bool]:
    fd = open_unbuffered(name)                            # None e.g. on tmpfs, or without O_DIRECT (Windows)
    used_direct = fd is not None
    if fd is None:
        fd = open_read(name)
    buf = _aligned(CHUNK)
    try:
        t0, offset = time.perf_counter(), 0
        while offset < nbytes:
            n = pread_into(fd, memoryview(buf)[:min(CHUNK, nbytes - offset)], offset)
            if n <= 0:
                raise OSError(f"{name}: short read at {offset}")
            offset += n
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        buf.close()
    return nbytes / max(seconds, 1e-9) / 1e9, used_direct
