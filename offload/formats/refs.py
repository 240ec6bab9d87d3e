"""Where one model tensor lives in a checkpoint: a stored tensor, or a piece of one (one expert of a fused
[E, ...] tensor, its interleaved gate or up columns, transposed), and how to read just that piece.

A TensorRef is data (it goes into the layer cache's manifest as it is), so the one rule that names a model
tensor's source (specexec/checkpoints/weight_map.py) serves every reader: the resident loader, the layer cache and
the checks before either. Reading a ref reads only its expert's bytes where the source can
(`get_index(name, i)`: safetensors slices its memory map, the MXFP4 source dequantizes one expert), else the
whole tensor and indexes it.

Does not know: model architectures, which family needs which piece, quantization for the cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:                                  # annotations only: naming a tensor's source needs no torch
    import torch


@dataclass(frozen=True)
class TensorRef:
    """Stored tensor `name`; with `index`, its slice [index] along dim 0, which must have `count` entries
    (one expert of a fused tensor); with step > 1, every step-th entry of the last dim from `start` (one of
    interleaved gate/up columns); with `length`, the rows [start, start + length) of the second-to-last dim
    (one of the stacked gate/up halves of a fused [.., 2I, D] tensor); with `transpose`, the last two dims
    swapped (an [in, out] tensor as [out, in])."""

    name: str
    index: int | None = None
    count: int | None = None
    start: int = 0
    step: int = 1
    transpose: bool = False
    length: int = 0

    @property
    def plain(self) -> bool:
        """The stored tensor as it is."""
        return self.index is None and self.step == 1 and not self.transpose and not self.length

    def describe(self) -> str:
        """For messages: the stored name, then the piece when not the whole tensor ("name[3][..., 0::2] transposed")."""
        piece = (f"[{self.index}]" if self.index is not None else "") + \
            (f"[..., {self.start}::{self.step}]" if self.step > 1 else "") + \
            (f"[..., {self.start}:{self.start + self.length}, :]" if self.length else "") + \
            (" transposed" if self.transpose else "")
        return self.name + piece

    def to_json(self) -> str | dict[str, Any]:
        """The manifest's form: the bare name for a plain ref (as layer caches always recorded it), else a dict."""
        if self.plain:
            return self.name
        return {k: v for k, v in vars(self).items() if v != _DEFAULTS[k]}


_DEFAULTS = {"name": None, "index": None, "count": None, "start": 0, "step": 1, "transpose": False, "length": 0}


def as_ref(source: str | TensorRef) -> TensorRef:
    return source if isinstance(source, TensorRef) else TensorRef(source)


def ref_shape(ref: TensorRef, stored: tuple[int, ...]) -> tuple[int, ...]:
    """The shape `ref` reads from a stored tensor of shape `stored`; CheckpointError naming the tensor when the
    stored tensor cannot hold that piece (too few dims, another expert count)."""
    from offload.formats.checkpoint import CheckpointError     # lazy: naming a source (the families) needs no torch

    shape = tuple(stored)
    if ref.index is not None:
        if not shape or (ref.count is not None and shape[0] != ref.count) or ref.index >= shape[0]:
            want = ref.count if ref.count is not None else f"more than {ref.index}"
            raise CheckpointError(f"{ref.name} has shape {list(stored)}: expected {want} experts along its first "
                                  "dimension, as config.json implies")
        shape = shape[1:]
    if ref.step > 1:
        if not shape:
            raise CheckpointError(f"{ref.name} has shape {list(stored)}: too few dimensions for its gate/up columns")
        shape = shape[:-1] + (len(range(ref.start, shape[-1], ref.step)),)
    if ref.length:
        if len(shape) < 2 or shape[-2] < ref.start + ref.length:
            raise CheckpointError(f"{ref.name} has shape {list(stored)}: too few rows for its rows "
                                  f"[{ref.start}, {ref.start + ref.length})")
        shape = shape[:-2] + (ref.length, shape[-1])
    if ref.transpose:
        if len(shape) < 2:
            raise CheckpointError(f"{ref.name} has shape {list(stored)}: too few dimensions to transpose")
        shape = shape[:-2] + (shape[-1], shape[-2])
    return shape


WEIGHT_ALIGN = 64          # bytes: where every weight a model computes with starts (torch's CPU allocator's own)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """t contiguous in memory that starts on a WEIGHT_ALIGN-byte boundary: t itself when it already is, else a
    copy. A safetensors tensor read as stored is a view of the file's memory map at whatever offset its header
    gave it (4-byte aligned at best), while a layer streamed from the layer cache sits in a slot at a multiple of
    64 (offload/streaming/storage.py). A BLAS GEMV's rounding follows its weight's address (MKL's SSE/AVX2 paths,
    which an AMD CPU runs, peel an unaligned head: a one-row product differs in the last bits), so a resident
    weight must sit as a streamed one does for the two to compute alike, bit for bit."""
    import torch                                  # lazy: naming a tensor's source (the families) needs no torch

    if t.is_contiguous() and t.data_ptr() % WEIGHT_ALIGN == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)          # the allocator's alignment (>= 64)
    return out.copy_(t)


def read_ref(source: Any, ref: TensorRef) -> torch.Tensor:
    """The tensor `ref` names, read from a checkpoint source (offload.formats.sources), contiguous."""
    if ref.plain:
        return source.get(ref.name)
    if ref.index is not None:
        ref_shape(ref, tuple(source.shape(ref.name)))
        getter = getattr(source, "get_index", None)
        t = getter(ref.name, ref.index) if getter is not None else source.get(ref.name)[ref.index]
    else:
        t = source.get(ref.name)
    if ref.step > 1:
        t = t[..., ref.start::ref.step]
    if ref.length:
        t = t[..., ref.start:ref.start + ref.length, :]
    if ref.transpose:
        t = t.transpose(-1, -2)
    return t.contiguous()
