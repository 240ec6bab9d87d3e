"""One tensor of a model as read from a checkpoint: a checkpoint tensor, then a fixed list of shape operations.

Most of a model's tensors are a checkpoint tensor under another name; some are a part of one (a fused tensor
split into its pieces, one expert of a stacked expert tensor, a transposed layout). `TensorSource(name, ops)`
says which: read `name`, then apply `ops` in order, each one of
    ("slice", dim, start, stop, step)    t[..., start:stop:step, ...] along dim
    ("select", dim, index)               t.select(dim, index) (the dimension goes)
    ("transpose", dim0, dim1)            t.transpose(dim0, dim1)
and the result is made contiguous. The same ops give the shape from the header alone (`shape`), so a
checkpoint is checked and a layer cache planned without reading data. A source is plain data: it goes into
a layer cache's fingerprint (`to_json`: just the name when there are no ops, as before this existed).

Does not know: which model or family wants which piece (specexec/families names them), quantization.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

OPS = ("slice", "select", "transpose")


@dataclass(frozen=True)
class TensorSource:
    """Checkpoint tensor `name` with `ops` applied (see the module docstring)."""

    name: str
    ops: tuple[tuple, ...] = ()

    def __post_init__(self) -> None:
        bad = [op for op in self.ops if not op or op[0] not in OPS]
        if bad:
            raise ValueError(f"unknown tensor op {bad[0]!r}; known: {', '.join(OPS)}")

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor this source describes, from the checkpoint tensor `t`."""
        for op in self.ops:
            if op[0] == "slice":
                _, dim, start, stop, step = op
                t = t[(slice(None),) * (dim % t.dim()) + (slice(start, stop, step),)]
            elif op[0] == "select":
                t = t.select(op[1], op[2])
            else:
                t = t.transpose(op[1], op[2])
        return t.contiguous() if self.ops else t

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape `apply` gives a checkpoint tensor of `shape` (computed on the meta device: no data)."""
        if not self.ops:
            return tuple(shape)
        return tuple(self.apply(torch.empty(shape, device="meta")).shape)

    def to_json(self) -> str | list:
        return self.name if not self.ops else [self.name, [list(op) for op in self.ops]]


def source_of(spec: str | TensorSource) -> TensorSource:
    """A layer-cache spec (a plain checkpoint name, or a TensorSource) as a TensorSource."""
    return spec if isinstance(spec, TensorSource) else TensorSource(spec)


def read(get: Callable[[str], torch.Tensor], spec: str | TensorSource) -> torch.Tensor:
    """The tensor `spec` describes, reading checkpoint tensors through get(name)."""
    src = source_of(spec)
    return src.apply(get(src.name))
