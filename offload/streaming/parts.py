"""Streaming a layer in parts: the read-ahead moves only its head (the first `head` bytes, e.g. a mixture of
experts' dense part), and the consumer, holding the layer in a slot, asks for more of its byte ranges (e.g. the
regions of the experts its rows were routed to) when it knows which: `fill_ranges`.

A range is copied from the layer's own tier to the same offsets of the slot, so the slot's bytes are laid out
as the whole layer (views bound to it stay valid): from the RAM tier by one copy each (on CUDA an async H2D
copy on the compute stream, in order with the layer's compute); from the SSD tier by a positional read of that
range alone (storage regions start and end on ALIGN: O_DIRECT-able), straight into the host slot on a CPU, on
CUDA through a pinned staging buffer the size of a slot (each fill waits for the previous fill's copies out
of it before reading into it again). A resident layer needs nothing.

Reads go through the reader's `read_part(i, offset, out)` (LayerCache: each region checked against its own
sha256 on its first read); a head shorter than the layer is read the same way (offset 0).

Does not know: what the ranges mean (the caller names them; experts are just sub-regions), tokens, models.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from offload.streaming.storage import ALIGN
from offload.streaming.tiers import host_buffer


def check_heads(heads: Sequence[int], sizes: Sequence[int]) -> list[int]:
    """The heads as a list; ValueError unless each is a positive multiple of ALIGN no larger than its layer."""
    out = list(heads)
    if len(out) != len(sizes) or any(h <= 0 or h % ALIGN or h > s for h, s in zip(out, sizes)):
        raise ValueError(f"layer heads must be positive multiples of {ALIGN}, one per layer, each at most its "
                         f"layer's bytes; got {out[:4]}... for sizes {list(sizes)[:4]}...")
    return out


def read_head(reader: Any, i: int, head: int, size: int, out: torch.Tensor) -> None:
    """Layer i's first `head` bytes into out (the whole layer when head == size)."""
    if head == size:
        reader.read_layer(i, out[:size])
    else:
        reader.read_part(i, 0, out[:head])


class RangeFiller:
    """The consumer-side fills of one LayerPager (see the module docstring); `moved` counts bytes per tier."""

    def __init__(self, pager: Any) -> None:
        self.pager = pager
        self._staging: torch.Tensor | None = None
        self._staged: Any = None                  # event after the last copies out of the staging buffer
        self.moved = {"ram": 0, "ssd": 0}

    def fill(self, i: int, slot: int, ranges: Sequence[tuple[int, int]]) -> int:
        """Copy layer i's byte ranges (offset, nbytes) into slot `slot` at the same offsets now; the bytes moved."""
        p = self.pager
        tier = p.tiers[i]
        if tier == "resident" or not ranges:
            return 0
        dst = p.slots[slot].buf
        for off, n in ranges:
            if off < 0 or off + n > p.sizes[i]:
                raise ValueError(f"range [{off}, {off + n}) is outside layer {i} ({p.sizes[i]} bytes)")
        if tier == "ram":
            src = p.ram.buffer(i)
            for off, n in ranges:
                dst[off:off + n].copy_(src[off:off + n], non_blocking=True)
        elif p.device.type != "cuda":
            for off, n in ranges:
                p.ssd.read_part(i, off, dst[off:off + n])
        else:
            self._through_staging(i, dst, ranges)
        moved = sum(n for _, n in ranges)
        self.moved[tier] += moved
        return moved

    def _through_staging(self, i: int, dst: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> None:
        p = self.pager
        if self._staging is None:
            self._staging = host_buffer(p.slot_bytes, pin=True)
        if self._staged is not None:
            self._staged.synchronize()            # the previous fill's copies out of the staging buffer are done
        for off, n in ranges:
            p.ssd.read_part(i, off, self._staging[off:off + n])
        for off, n in ranges:
            dst[off:off + n].copy_(self._staging[off:off + n], non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record(torch.cuda.current_stream(p.device))
