"""Packed layers: one decoder layer's tensors (quantized data + quantization state + norms/biases) in ONE
contiguous uint8 buffer with an offset table, so moving a layer between tiers is a single copy and the
tensors are rebuilt on the destination as views without allocation.

Does not know: what the tensors mean (names are opaque), models, tokens, files.

CONTRACT (shared by quant.py, cache.py, tiers.py, pager.py):

    ALIGN = 4096                                   # every packed layer's size is a multiple of ALIGN (O_DIRECT)
    ENTRY_ALIGN = 64                               # every tensor starts at a multiple of 64 bytes

    @dataclass(frozen=True)
    class Entry:                                   # one tensor inside a packed buffer
        name: str; dtype: str; shape: tuple[int, ...]; offset: int; nbytes: int
                                                   # dtype as "bfloat16"; offsets are 64-byte aligned

    @dataclass(frozen=True)
    class LayerLayout:                             # json-serialisable via to_dict()/from_dict()
        entries: tuple[Entry, ...]                 # in packing order
        nbytes: int                                # padded total, multiple of ALIGN
        meta: dict                                 # opaque json-able metadata (e.g. quantization state fields)
        def entry(name) -> Entry; names() -> list[str]

    def plan_layout(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], meta: dict | None = None) -> LayerLayout
        # the layout pack_layer would produce, from dtypes/shapes only (for planning and synthetic layers)
    def pack_layer(tensors: dict[str, torch.Tensor], meta: dict | None = None) -> tuple[torch.Tensor, LayerLayout]
        # -> (uint8 [layout.nbytes] CPU buffer, layout); padding bytes are zero
    def pack_into(buffer: torch.Tensor, tensors: dict[str, torch.Tensor], layout: LayerLayout) -> torch.Tensor
        # copy tensors into an existing uint8 buffer (any device, >= layout.nbytes) laid out as `layout`
    def unpack_layer(buffer: torch.Tensor, layout: LayerLayout) -> dict[str, torch.Tensor]
        # views into `buffer` (any device), no allocation. `buffer` is uint8, 1-D, contiguous, may be LONGER
        # than layout.nbytes (a slot sized for the largest layer), and must start 64-byte aligned in its storage
        # (storage_offset % 64 == 0), which every buffer from pack_layer / torch.empty / a slot split at ALIGN is.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

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
class LayerLayout:
    """Offset table of one packed layer; nbytes is a multiple of ALIGN."""
    entries: tuple[Entry, ...]
    nbytes: int
    meta: dict = field(default_factory=dict, hash=False, compare=True)

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(f"no tensor {name!r} in this packed layer")

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def to_dict(self) -> dict:
        return {"entries": [e.to_dict() for e in self.entries], "nbytes": self.nbytes, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> LayerLayout:
        layout = cls(tuple(Entry.from_dict(e) for e in d["entries"]), int(d["nbytes"]), dict(d.get("meta") or {}))
        layout.check()
        return layout

    def check(self) -> None:
        """ValueError unless entries are aligned, in bounds, non-overlapping and sized by dtype x shape."""
        if self.nbytes % ALIGN:
            raise ValueError(f"packed layer size {self.nbytes} is not a multiple of {ALIGN}")
        end = 0
        for e in self.entries:
            size = _dtype(e.dtype).itemsize * _numel(e.shape)
            if e.offset % ENTRY_ALIGN or e.offset < end or e.nbytes != size or e.offset + e.nbytes > self.nbytes:
                raise ValueError(f"bad packed entry {e} (previous entry ends at {end}, layer has {self.nbytes} bytes)")
            end = e.offset + e.nbytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def plan_layout(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], meta: dict | None = None) -> LayerLayout:
    """The layout of `specs` (name -> (dtype, shape)) packed in the given order."""
    meta = dict(meta or {})
    json.dumps(meta)                                  # fail here, not when the manifest is written
    entries, offset = [], 0
    for name, (dtype, shape) in specs.items():
        nbytes = dtype.itemsize * _numel(tuple(shape))
        entries.append(Entry(name, _dtype_name(dtype), tuple(int(s) for s in shape), offset, nbytes))
        offset = round_up(offset + nbytes, ENTRY_ALIGN)
    return LayerLayout(tuple(entries), max(round_up(offset, ALIGN), ALIGN), meta)


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


def pack_layer(tensors: dict[str, torch.Tensor], meta: dict | None = None) -> tuple[torch.Tensor, LayerLayout]:
    """(uint8 [layout.nbytes] CPU buffer holding every tensor, layout); padding bytes are zero."""
    layout = plan_layout({n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()}, meta)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    return pack_into(buffer, {n: t.detach().cpu() for n, t in tensors.items()}, layout), layout


def unpack_layer(buffer: torch.Tensor, layout: LayerLayout) -> dict[str, torch.Tensor]:
    """name -> view into `buffer` (same device); nothing is allocated or copied."""
    _check_buffer(buffer, layout)
    return {e.name: _view(buffer, e) for e in layout.entries}
