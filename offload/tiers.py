"""Where packed layers live between passes: device-resident, a RAM region, or a file on the SSD.

- `ResidentTier`: layers kept on the device (GPU, or plain memory on CPU) in ONE allocation split into slices;
  they are used in place, never copied.
- `RamTier`: ONE host region (page-aligned; pinned with cudaHostRegister when CUDA is in use, so torch's
  caching host allocator, which rounds blocks up to a power of two, never doubles it) split into layer slices.
- `PackedFile`: a file of packed layers at 4 KiB-aligned offsets read with O_DIRECT (falling back to buffered
  reads followed by posix_fadvise(DONTNEED), so the page cache does not keep a second copy of what was read).
  Any object with the `LayerReader` protocol (e.g. the disk cache of offload/cache.py) serves the SSD tier.

Also: aligned host buffers (`host_buffer`), pinning, and raw bandwidth probes used by the benchmark.

Does not know: what the bytes mean (storage.py), which layer goes where (planner.py), when to copy (pager.py).
"""
from __future__ import annotations

import errno
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from .storage import ALIGN, round_up

READ_CHUNK = 64 * 2**20           # bytes per read syscall: large and sequential


class LayerReader(Protocol):
    """Packed layers readable by index (the SSD tier): `nbytes(i)` multiple of ALIGN; `read_layer(i, out)`
    fills out[:nbytes(i)] (uint8, CPU, ALIGN-aligned start) with layer i's packed bytes."""

    def nbytes(self, i: int) -> int: ...

    def read_layer(self, i: int, out: torch.Tensor) -> None: ...


# ----------------------------------------------------------------------------------------- host memory

def host_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """uint8 [nbytes] CPU tensor whose data starts on an ALIGN boundary (O_DIRECT-able), allocated once.
    pin=True registers it with CUDA (page-locked) instead of going through torch's caching host allocator."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    buf = raw[start:start + nbytes]
    if pin and nbytes:
        _register(buf)
    return buf


def _register(buf: torch.Tensor) -> None:
    """Page-lock `buf` in place; it stays registered until the process ends (cudaHostUnregister is not
    needed: the region lives as long as the tier, which lives as long as the model)."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.numel()} bytes failed ({err}); lower --ram-budget")


def is_pinned(buf: torch.Tensor) -> bool:
    return buf.device.type == "cpu" and torch.cuda.is_available() and buf.is_pinned()


def split(region: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Consecutive slices of `region` of the given sizes (each a multiple of ALIGN, so each stays aligned)."""
    out, offset = [], 0
    for n in sizes:
        out.append(region[offset:offset + n])
        offset += round_up(n, ALIGN)
    return out


# ----------------------------------------------------------------------------------------- tiers

class ResidentTier:
    """Layers held on `device` for good: one allocation, one slice per layer, used in place."""

    name = "resident"

    def __init__(self, sizes: dict[int, int], device: torch.device) -> None:
        ids = sorted(sizes)
        total = sum(round_up(sizes[i], ALIGN) for i in ids)
        region = host_buffer(total) if device.type == "cpu" else torch.empty(total, dtype=torch.uint8, device=device)
        self.buffers: dict[int, torch.Tensor] = dict(zip(ids, split(region, [sizes[i] for i in ids])))
        self.nbytes = total

    def buffer(self, i: int) -> torch.Tensor:
        return self.buffers[i]


class RamTier:
    """Layers held in ONE host region (pinned when `pin`), one slice per layer; copied into device slots."""

    name = "ram"

    def __init__(self, sizes: dict[int, int], pin: bool) -> None:
        ids = sorted(sizes)
        total = sum(round_up(sizes[i], ALIGN) for i in ids)
        self.region = host_buffer(total, pin=pin)
        self.buffers: dict[int, torch.Tensor] = dict(zip(ids, split(self.region, [sizes[i] for i in ids])))
        self.nbytes, self.pinned = total, pin

    def buffer(self, i: int) -> torch.Tensor:
        return self.buffers[i]


def fill(buffers: dict[int, torch.Tensor], source: LayerReader, bounce: torch.Tensor | None = None) -> None:
    """Load every layer of a tier from `source` (at startup). Host buffers are read into directly; device
    buffers go through `bounce` (a host buffer >= the largest layer)."""
    for i, buf in buffers.items():
        n = source.nbytes(i)
        if buf.device.type == "cpu":
            source.read_layer(i, buf[:n])
        else:
            if bounce is None:
                bounce = host_buffer(max(source.nbytes(j) for j in buffers))
            source.read_layer(i, bounce[:n])
            buf[:n].copy_(bounce[:n])


# ----------------------------------------------------------------------------------------- the file

class PackedFile:
    """A file of packed layers, layer i at offsets[i] (multiples of ALIGN), read with O_DIRECT when the file
    system allows it. Thread-safe: reads use pread on one descriptor."""

    def __init__(self, path: str | os.PathLike, offsets: Sequence[int], sizes: Sequence[int],
                 direct: bool = True) -> None:
        self.path, self.offsets, self.sizes = Path(path), list(offsets), list(sizes)
        if any(o % ALIGN or s % ALIGN for o, s in zip(self.offsets, self.sizes)):
            raise ValueError(f"{self.path}: layer offsets and sizes must be multiples of {ALIGN}")
        self.direct = False
        self.fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd, self.direct = os.open(self.path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
        if self.fd < 0:
            self.fd = os.open(self.path, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    @classmethod
    def write(cls, path: str | os.PathLike, buffers: Sequence[torch.Tensor], direct: bool = True) -> "PackedFile":
        """Write packed layer buffers (uint8 CPU, sizes multiples of ALIGN) back to back, fsync'd."""
        offsets, offset = [], 0
        with open(path, "wb") as f:
            for b in buffers:
                offsets.append(offset)
                f.write(memoryview(b.contiguous().numpy()))
                offset += b.numel()
            f.flush()
            os.fsync(f.fileno())
        return cls(path, offsets, [b.numel() for b in buffers], direct)

    def nbytes(self, i: int) -> int:
        return self.sizes[i]

    def read_layer(self, i: int, out: torch.Tensor) -> None:
        read_exact(self.fd, out[:self.sizes[i]], self.offsets[i], fadvise_drop=not self.direct)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


def read_exact(fd: int, out: torch.Tensor, offset: int, fadvise_drop: bool = False) -> None:
    """Fill `out` (uint8 CPU, contiguous) from fd at `offset` in READ_CHUNK reads; EOFError if the file ends.
    fadvise_drop: tell the kernel the pages just read are not needed again (buffered reads only)."""
    view = memoryview(out.numpy()).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:done + READ_CHUNK]], offset + done)
        if n == 0:
            raise EOFError(f"file ends at {offset + done}, {len(view) - done} bytes short of a packed layer")
        done += n
    if fadvise_drop and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)


# ----------------------------------------------------------------------------------------- bandwidth probes

def probe_read(source: LayerReader, ids: Sequence[int], out: torch.Tensor) -> float:
    """Bytes per second reading layers `ids` from `source` into `out` one after another (the SSD tier's raw
    rate: same reader, same file, same page-cache state as the pager)."""
    t0, total = time.perf_counter(), 0
    for i in ids:
        source.read_layer(i, out)
        total += source.nbytes(i)
    return total / max(time.perf_counter() - t0, 1e-9)


def probe_copy(srcs: Sequence[torch.Tensor], dst: torch.Tensor) -> float:
    """Bytes per second copying each of `srcs` into `dst` (host region -> device slot; RAM tier's raw rate)."""
    sync = (lambda: torch.cuda.synchronize(dst.device)) if dst.device.type == "cuda" else (lambda: None)
    sync()
    t0, total = time.perf_counter(), 0
    for s in srcs:
        dst[:s.numel()].copy_(s, non_blocking=True)
        total += s.numel()
    sync()
    return total / max(time.perf_counter() - t0, 1e-9)
