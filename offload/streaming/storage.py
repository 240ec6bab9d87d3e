"""Packed layers: one decoder layer's tensors (quantized data + quantization state + norms/biases) in ONE
contiguous uint8 buffer with an offset table, so moving a layer between tiers is a single copy and the
tensors are rebuilt on the destination as views without allocation.

Regions: a layer may be split into named sub-regions (e.g. the experts of a mixture-of-experts layer), each
starting on an ALIGN boundary and padded to ALIGN, so one region can be read (O_DIRECT) or copied alone. The
caller names each region by a tensor-name prefix: a tensor belongs to the first region whose prefix it starts
with, every other tensor to the leading unnamed region (the "dense" part, offset 0). Without regions the
layer is one region, packed in the given order, as before.

Does not know: what the tensors or regions mean (names are opaque), models, tokens, files.

CONTRACT (shared by quant.py, cache.py, tiers.py, pager.py):

    ALIGN = 4096                                   # every packed layer's size is a multiple of ALIGN (O_DIRECT)
    ENTRY_ALIGN = 64                               # every tensor starts at a multiple of 64 bytes

    @dataclass(frozen=True)
    class Entry:                                   # one tensor inside a packed buffer
        name: str; dtype: str; shape: tuple[int, ...]; offset: int; nbytes: int
                                                   # dtype as "bfloat16"; offsets are 64-byte aligned

    @dataclass(frozen=True)
    class Region:                                  # a named sub-region, bytes [offset, offset + nbytes)
        name: str; offset: int; nbytes: int        # both multiples of ALIGN; name: the prefix that made it

    @dataclass(frozen=True)
    class LayerLayout:                             # json-serialisable via to_dict()/from_dict()
        entries: tuple[Entry, ...]                 # in packing order
        nbytes: int                                # padded total, multiple of ALIGN
        meta: dict                                 # opaque json-able metadata (e.g. quantization state fields)
        regions: tuple[Region, ...] = ()           # named sub-regions, ascending; () = none
        def entry(name) -> Entry; names() -> list[str]; region(name) -> Region   (each a dict lookup)
        def part_index(offset, nbytes) -> int | None   # 0 the dense part, k + 1 region k
        dense_nbytes: int                          # bytes before the first region (all of them without any)
        def region_entries(name) -> list[Entry]    # a region's entries (offsets as in the layer)

    def plan_layout(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], meta: dict | None = None,
                    regions: Sequence[str] = ()) -> LayerLayout
        # the layout pack_layer would produce, from dtypes/shapes only (for planning and synthetic layers)
    def pack_layer(tensors: dict[str, torch.Tensor], meta: dict | None = None, regions: Sequence[str] = ()
                   ) -> tuple[torch.Tensor, LayerLayout]
        # -> (uint8 [layout.nbytes] CPU buffer, layout); padding bytes are zero
    def pack_into(buffer: torch.Tensor, tensors: dict[str, torch.Tensor], layout: LayerLayout) -> torch.Tensor
        # copy tensors into an existing uint8 buffer (any device, >= layout.nbytes) laid out as `layout`
    def unpack_region(buffer: torch.Tensor, layout: LayerLayout, name: str) -> dict[str, torch.Tensor]
        # views of region `name`'s tensors in a buffer holding only that region's bytes (e.g. an expert cache)
    def unpack_layer(buffer: torch.Tensor, layout: LayerLayout) -> dict[str, torch.Tensor]
        # views into `buffer` (any device), no allocation. `buffer` is uint8, 1-D, contiguous, may be LONGER
        # than layout.nbytes (a slot sized for the largest layer), and must start 64-byte aligned in its storage
        # (storage_offset % 64 == 0), which every buffer from pack_layer / torch.empty / a slot split at ALIGN is.
"""
from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

ALIGN = 4096
ENTRY_ALIGN = 64


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a packed layout")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Entry:
    """One tensor inside a packed buffer: bytes [offset, offset + nbytes), dtype name, shape."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, d: dict) -> Entry:
        return cls(str(d["name"]), str(d["dtype"]), tuple(int(s) for s in d["shape"]), int(d["offset"]),
                   int(d["nbytes"]))


@dataclass(frozen=True)
class Region:
    """A named sub-region of a packed layer: bytes [offset, offset + nbytes), both multiples of ALIGN; `name` is
    the tensor-name prefix its entries share."""
    name: str
    offset: int
    nbytes: int

    def to_dict(self) -> dict:
        return {"name": self.name, "offset": self.offset, "nbytes": self.nbytes}


@dataclass(frozen=True)
class LayerLayout:
    """Offset table of one packed layer; nbytes is a multiple of ALIGN; `regions` its named sub-regions."""
    entries: tuple[Entry, ...]
    nbytes: int
    meta: dict = field(default_factory=dict, hash=False, compare=True)
    regions: tuple[Region, ...] = ()

    def region(self, name: str) -> Region:
        r = self._regions_by_name.get(name)
        if r is None:
            raise KeyError(f"no region {name!r} in this packed layer")
        return r

    # Lookups by name and by offset, built once per layout: a sparse layer of E experts has E regions and 3E
    # entries, and a scan per lookup made planning and streaming O(E^2) (65,536 experts: minutes).
    @cached_property
    def _regions_by_name(self) -> dict[str, Region]:
        return {r.name: r for r in self.regions}

    @cached_property
    def _parts(self) -> dict[tuple[int, int], int]:
        """(offset, nbytes) -> part: 0 the dense part, k + 1 region k (none without regions)."""
        if not self.regions:
            return {}
        return {(0, self.dense_nbytes): 0, **{(r.offset, r.nbytes): k + 1 for k, r in enumerate(self.regions)}}

    def part_index(self, offset: int, nbytes: int) -> int | None:
        """Which part bytes [offset, offset + nbytes) are: 0 the dense part, k + 1 region k; None if not one."""
        return self._parts.get((offset, nbytes))

    @cached_property
    def _entries_by_name(self) -> dict[str, Entry]:
        return {e.name: e for e in self.entries}

    @cached_property
    def _offsets(self) -> list[int]:
        return [e.offset for e in self.entries]              # ascending (check(); plan_layout packs in order)

    def _within(self, start: int, end: int) -> tuple[Entry, ...]:
        """The entries starting in [start, end)."""
        return self.entries[bisect_left(self._offsets, start):bisect_left(self._offsets, end)]

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the leading unnamed region (ALIGN-padded): the whole layer when it has no regions."""
        return self.regions[0].offset if self.regions else self.nbytes

    def region_entries(self, name: str) -> list[Entry]:
        """The entries inside region `name` (offsets as in the whole layer)."""
        r = self.region(name)
        return list(self._within(r.offset, r.offset + r.nbytes))

    def entry(self, name: str) -> Entry:
        e = self._entries_by_name.get(name)
        if e is None:
            raise KeyError(f"no tensor {name!r} in this packed layer")
        return e

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def to_dict(self) -> dict:
        out = {"entries": [e.to_dict() for e in self.entries], "nbytes": self.nbytes, "meta": self.meta}
        if self.regions:                              # absent for a layer without: its manifest reads as before
            out["regions"] = [r.to_dict() for r in self.regions]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> LayerLayout:
        regions = tuple(Region(str(r["name"]), int(r["offset"]), int(r["nbytes"])) for r in d.get("regions") or ())
        layout = cls(tuple(Entry.from_dict(e) for e in d["entries"]), int(d["nbytes"]), dict(d.get("meta") or {}),
                     regions)
        layout.check()
        return layout

    def check(self) -> None:
        """ValueError unless entries are aligned, in bounds, non-overlapping and sized by dtype x shape, and the
        regions ALIGN-aligned, ascending, in bounds, each holding only entries of its prefix."""
        if self.nbytes % ALIGN:
            raise ValueError(f"packed layer size {self.nbytes} is not a multiple of {ALIGN}")
        end = 0
        for e in self.entries:
            size = _dtype(e.dtype).itemsize * _numel(e.shape)
            if e.offset % ENTRY_ALIGN or e.offset < end or e.nbytes != size or e.offset + e.nbytes > self.nbytes:
                raise ValueError(f"bad packed entry {e} (previous entry ends at {end}, layer has {self.nbytes} bytes)")
            end = e.offset + e.nbytes
        end = 0
        for r in self.regions:
            if r.offset % ALIGN or r.nbytes % ALIGN or r.offset < end or r.offset + r.nbytes > self.nbytes:
                raise ValueError(f"bad packed region {r} (previous region ends at {end}, layer has {self.nbytes} "
                                 "bytes)")
            end = r.offset + r.nbytes
            inside = self._within(r.offset, end)
            if any(not e.name.startswith(r.name) or e.offset + e.nbytes > end for e in inside):
                raise ValueError(f"packed region {r.name!r} holds an entry of another region or overruns its end")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def plan_layout(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], meta: dict | None = None,
                regions: Sequence[str] = ()) -> LayerLayout:
    """The layout of `specs` (name -> (dtype, shape)) packed in the given order; with `regions` (tensor-name
    prefixes), the tensors of no region first, then each region's, each region from an ALIGN boundary."""
    meta = dict(meta or {})
    json.dumps(meta)                                  # fail here, not when the manifest is written
    entries, placed, offset = [], [], 0
    for k, names in enumerate(_grouped(list(specs), regions)):
        start = offset = round_up(offset, ALIGN) if k else offset     # a named region starts on ALIGN
        for name in names:
            dtype, shape = specs[name]
            nbytes = dtype.itemsize * _numel(tuple(shape))
            entries.append(Entry(name, _dtype_name(dtype), tuple(int(s) for s in shape), offset, nbytes))
            offset = round_up(offset + nbytes, ENTRY_ALIGN)
        if k:
            placed.append(Region(regions[k - 1], start, round_up(offset, ALIGN) - start))
    return LayerLayout(tuple(entries), max(round_up(offset, ALIGN), ALIGN), meta, tuple(placed))


def _grouped(names: list[str], regions: Sequence[str]) -> list[list[str]]:
    """[the names of no region, then each region's names] (a name goes to the first prefix it starts with);
    ValueError for a prefix given twice or one that no tensor has."""
    if len(set(regions)) != len(regions):
        raise ValueError("a packed layer's region prefixes must be distinct")
    groups: list[list[str]] = [[] for _ in range(len(regions) + 1)]
    index = {prefix: j + 1 for j, prefix in enumerate(regions)}
    lengths = sorted({len(prefix) for prefix in regions})            # a few: a lookup per length, not per prefix
    for name in names:
        hits = [index[name[:n]] for n in lengths if n <= len(name) and name[:n] in index]
        groups[min(hits, default=0)].append(name)
    empty = [regions[j] for j, g in enumerate(groups[1:]) if not g]
    if empty:
        raise ValueError(f"packed region {empty[0]!r} holds no tensor")
    return groups


def _check_buffer(buffer: torch.Tensor, layout: LayerLayout) -> None:
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"a packed buffer is a contiguous 1-D uint8 tensor, got {buffer.dtype} {list(buffer.shape)}")
    if buffer.numel() < layout.nbytes:
        raise ValueError(f"buffer of {buffer.numel()} bytes is too small for a packed layer of {layout.nbytes}")
    if buffer.storage_offset() % ENTRY_ALIGN:
        raise ValueError(f"buffer starts at storage offset {buffer.storage_offset()}, not {ENTRY_ALIGN}-byte aligned")


def _view(buffer: torch.Tensor, e: Entry) -> torch.Tensor:
    """The tensor of entry e as a view of buffer."""
    return buffer[e.offset:e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape)


def pack_into(buffer: torch.Tensor, tensors: dict[str, torch.Tensor], layout: LayerLayout) -> torch.Tensor:
    """Copy `tensors` into `buffer` (uint8, >= layout.nbytes, any device) at layout's offsets; returns buffer."""
    _check_buffer(buffer, layout)
    if set(tensors) != set(layout.names()):
        raise ValueError(f"tensors {sorted(tensors)} do not match the layout's {layout.names()}")
    for e in layout.entries:
        t = tensors[e.name]
        if _dtype_name(t.dtype) != e.dtype or tuple(t.shape) != e.shape:
            raise ValueError(f"{e.name}: {t.dtype} {list(t.shape)} does not match the layout "
                             f"({e.dtype} {list(e.shape)})")
        _view(buffer, e).copy_(t)
    return buffer


def pack_layer(tensors: dict[str, torch.Tensor], meta: dict | None = None, regions: Sequence[str] = ()
               ) -> tuple[torch.Tensor, LayerLayout]:
    """(uint8 [layout.nbytes] CPU buffer holding every tensor, layout, regions as plan_layout); padding bytes
    are zero."""
    layout = plan_layout({n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, meta, regions)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    return pack_into(buffer, {n: t.detach().cpu() for n, t in tensors.items()}, layout), layout


def unpack_layer(buffer: torch.Tensor, layout: LayerLayout) -> dict[str, torch.Tensor]:
    """name -> view into `buffer` (same device); nothing is allocated or copied."""
    _check_buffer(buffer, layout)
    return {e.name: _view(buffer, e) for e in layout.entries}


def unpack_region(buffer: torch.Tensor, layout: LayerLayout, name: str) -> dict[str, torch.Tensor]:
    """name -> view of region `name`'s tensors in `buffer`, which holds that region's bytes alone (uint8, 1-D,
    >= the region's nbytes, 64-byte aligned), e.g. a slot of a device cache of regions; nothing is copied."""
    r = layout.region(name)
    _check_buffer(buffer, LayerLayout((), r.nbytes))
    return {e.name: _view(buffer, Entry(e.name, e.dtype, e.shape, e.offset - r.offset, e.nbytes))
            for e in layout.region_entries(name)}
