"""Where packed layers live between passes: device-resident, a RAM region, or a file on the SSD (read by a
LayerReader).

- `ResidentTier`: layers kept on the device (GPU, or plain memory on CPU) in ONE allocation split into slices;
  they are used in place, never copied.
- `RamTier`: ONE host region (page-aligned; pinned with cudaHostRegister when CUDA is in use, so torch's
  caching host allocator, which rounds blocks up to a power of two, never doubles it) split into layer slices.
  Where registration is unavailable or refused (some drivers, WSL2), the region comes from torch's pinned
  allocator instead, as a few blocks whose sizes it does not round up much (`pinned_regions`).
  A registered region is unregistered (cudaHostUnregister) when its last view is freed, before its memory is:
  whoever drops one first makes sure no copy into or out of it is still queued (the pager's `discard` and the
  KV rows' event waits do), so a long chat that regrows its pinned KV rows keeps only the live ones locked.
- the SSD tier: any object with the `LayerReader` protocol; a run's is the layer cache (offload/cache/store.py
  LayerCache: O_DIRECT reads where the file system allows them, each layer's checksum on its first read).

Also: aligned host buffers (`host_buffer`), pinning, and raw bandwidth probes used by the benchmark.

Does not know: what the bytes mean (storage.py), which layer goes where (planner.py), when to copy (pager.py).
"""
from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Protocol

import numpy
import torch

from offload.streaming.storage import ALIGN, round_up



class LayerReader(Protocol):
    """Packed layers readable by index (the SSD tier): `nbytes(i)` multiple of ALIGN; `read_layer(i, out)`
    fills out[:nbytes(i)] (uint8, CPU, ALIGN-aligned start) with layer i's packed bytes. A layer streamed in
    parts (parts.py) is also read by `read_part(i, offset, out)`: out.numel() bytes from `offset` (both
    multiples of ALIGN)."""

    def nbytes(self, i: int) -> int: ...

    def read_layer(self, i: int, out: torch.Tensor) -> None: ...


# ----------------------------------------------------------------------------------------- host memory

class PinFallbackWarning(RuntimeWarning):
    """cudaHostRegister was unavailable or refused: host memory is pinned by torch's allocator instead."""


def host_buffer(nbytes: int, pin: bool = False) -> torch.Tensor:
    """uint8 [nbytes] CPU tensor whose data starts on an ALIGN boundary (O_DIRECT-able), allocated once.
    pin=True page-locks it for CUDA (`pinned_regions`)."""
    if pin and nbytes:
        return pinned_regions([nbytes])[0][:nbytes]      # a region is rounded up to ALIGN; the caller asked less
    return _aligned(nbytes)


def _aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start:start + nbytes]


def pinned_regions(sizes: Sequence[int]) -> list[torch.Tensor]:
    """Page-locked host memory for consecutive slices of `sizes` bytes (each a multiple of ALIGN): ONE aligned
    region registered in place with cudaHostRegister; where that is unavailable or refused, regions from
    torch's pinned allocator (pin_memory), one per group of `pin_groups` (a PinFallbackWarning says so once)."""
    total = sum(round_up(n, ALIGN) for n in sizes)
    region, owner = _lockable(total)
    why = _register(region)
    if why is None:
        _unregister_with(owner, region.data_ptr())
        return [region]
    del region, owner
    _warn_once(f"{why}; pinning host memory with torch's allocator instead (it may reserve more RAM)")
    out = []
    for group in pin_groups([round_up(n, ALIGN) for n in sizes]):
        nbytes = sum(group)
        try:
            out.append(_pin_memory(nbytes))
        except RuntimeError as e:
            raise RuntimeError(f"pinning {nbytes} bytes of host memory failed ({e}); lower --ram-budget") from None
    return out


def pin_groups(sizes: Sequence[int]) -> list[list[int]]:
    """`sizes` split into consecutive groups, one pinned block each, so that torch's pinned allocator, which
    rounds every block up to a power of two, reserves as little as it can: one block when the total is just
    under a power of two, else groups that each fill the largest power of two what is left reaches (each
    wastes less than one size; about log2(len(sizes)) groups)."""
    greedy: list[list[int]] = []
    i = 0
    while i < len(sizes):
        cap = 1 << (sum(sizes[i:]).bit_length() - 1)           # largest power of two <= what is left
        cap = max(cap, _pow2(sizes[i]))                        # at least the next size, rounded up
        group, total = [], 0
        while i < len(sizes) and total + sizes[i] <= cap:
            group.append(sizes[i])
            total += sizes[i]
            i += 1
        greedy.append(group)
    return min([list(sizes)], greedy, key=lambda groups: (pinned_reserve(groups), len(groups)))


def pinned_reserve(groups: Sequence[Sequence[int]]) -> int:
    """Bytes torch's pinned allocator reserves for one block per group (each rounded up to a power of two)."""
    return sum(_pow2(sum(g)) for g in groups if sum(g))


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _lockable(nbytes: int) -> tuple[torch.Tensor, object]:
    """(an ALIGN-aligned uint8 [nbytes] CPU tensor, the object that owns its memory): the tensor and every view of
    it keep the owner (a numpy array) alive, and the owner is finalized, before its memory is freed, when the
    last of them goes: the moment to unregister a pinned region."""
    owner = numpy.empty(nbytes + ALIGN, dtype=numpy.uint8)
    raw = torch.from_numpy(owner)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start:start + nbytes], owner


def _unregister_with(owner: object, ptr: int) -> None:
    """cudaHostUnregister(ptr) when `owner` is finalized (its last view freed), not at interpreter exit (the
    process's end unpins everything)."""
    weakref.finalize(owner, _unregister, ptr).atexit = False


def _unregister(ptr: int) -> None:
    """Unpin a region registered at `ptr` (a finalizer: never raises; a failure's error is drained)."""
    try:
        if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
            _drain_cuda_error()
    except Exception:                                   # noqa: BLE001 -- a finalizer must not raise
        pass


def _pin_memory(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _register(buf: torch.Tensor) -> str | None:
    """Page-lock `buf` in place (cudaHostRegister); None when done, else why not (`_unregister_with` unlocks
    it when its memory is freed)."""
    try:
        register = torch.cuda.cudart().cudaHostRegister
    except (AttributeError, RuntimeError, AssertionError, OSError) as e:
        return f"cudaHostRegister is unavailable ({type(e).__name__}: {e})"
    err = register(buf.data_ptr(), buf.numel(), 0)
    if int(err) != 0:
        _drain_cuda_error()
        return f"cudaHostRegister of {buf.numel()} bytes failed ({err})"
    return None


def _drain_cuda_error() -> None:
    """A failed CUDA runtime call stays cudaGetLastError's answer until read, and torch reads it after its next
    kernel launch, reporting it as that kernel's error. torch's cudart bindings lack cudaGetLastError: launch
    one tiny kernel here, where that error is expected, and let its launch check consume it."""
    try:
        torch.empty(1, device="cuda").fill_(1)
    except RuntimeError:
        pass


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    key = message.split(" (")[0]
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, PinFallbackWarning, stacklevel=3)


def is_pinned(buf: torch.Tensor) -> bool:
    return buf.device.type == "cpu" and torch.cuda.is_available() and buf.is_pinned()


def split(region: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Consecutive slices of `region` of the given sizes (each a multiple of ALIGN, so each stays aligned)."""
    out, offset = [], 0
    for n in sizes:
        out.append(region[offset:offset + n])
        offset += round_up(n, ALIGN)
    return out


def split_regions(regions: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[torch.Tensor]:
    """Consecutive slices of the given sizes, filling each region in turn (the regions of `pinned_regions`)."""
    out: list[torch.Tensor] = []
    k = 0
    for region in regions:
        room = region.numel()
        take = []
        while k < len(sizes) and round_up(sizes[k], ALIGN) <= room:
            take.append(sizes[k])
            room -= round_up(sizes[k], ALIGN)
            k += 1
        out += split(region, take)
    if k != len(sizes):
        raise ValueError(f"regions of {[r.numel() for r in regions]} bytes cannot hold slices of {list(sizes)}")
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
    """Layers held in ONE host region (pinned when `pin`; `pinned_regions` may need a few), one slice per layer;
    copied into device slots."""

    name = "ram"

    def __init__(self, sizes: dict[int, int], pin: bool) -> None:
        ids = sorted(sizes)
        order = [sizes[i] for i in ids]
        total = sum(round_up(n, ALIGN) for n in order)
        self.regions = pinned_regions(order) if pin and total else [host_buffer(total)]
        self.buffers: dict[int, torch.Tensor] = dict(zip(ids, split_regions(self.regions, order)))
        self.nbytes, self.pinned = total, pin

    @property
    def region(self) -> torch.Tensor:
        """The one region (ValueError where pinning fell back to several)."""
        if len(self.regions) != 1:
            raise ValueError(f"the RAM tier is {len(self.regions)} pinned regions, not one")
        return self.regions[0]

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
