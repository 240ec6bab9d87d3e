"""Count host synchronisations as a CPU test: the ops whose result the host must wait for on a GPU.

`SyncCounter` is a context manager (a TorchDispatchMode plus a TorchFunctionMode) that counts, on any device:
- reads of tensor data into Python: `item`/`int()`/`float()`/`bool()`/`if t:` (aten item, _local_scalar_dense,
  is_nonzero), `tolist()`, `numpy()`, `torch.equal`/`allclose`;
- ops whose output shape depends on the data: `nonzero`/`argwhere`, `masked_select`, boolean-mask indexing
  (`x[mask]`, `x[mask] = y`), `unique`, `repeat_interleave` with tensor repeats;
- copies from a device to the host (`.cpu()`, `.to("cpu")`; none on a CPU-only run).
On a CPU run these cost nothing, but the same code on CUDA stalls the host until the GPU catches up, so the
count is what a GPU would pay. `uploads` counts tensors made from Python data (`torch.tensor(list)`, indexing
with a list), which on CUDA are blocking host-to-device copies unless written with non_blocking=True; Python
scalars (`x[0] = 1.0`, `torch.where(m, x, 0.0)`) are not counted, CUDA fills them in a kernel.

`count_calls(module)` counts forward calls of a module (e.g. the draft: its draft passes).

Does not know: specexec; it only watches torch ops.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_READS = {"item", "_local_scalar_dense", "is_nonzero", "equal", "allclose"}
_DATA_SHAPED = {"nonzero", "nonzero_numpy", "argwhere", "masked_select", "unique", "_unique", "_unique2",
                "unique_dim", "unique_consecutive", "unique_dim_consecutive"}
_INDEX = {"index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"}
_FUNCTION_READS = {"tolist", "numpy", "__array__"}


def _is_bool_tensor(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.bool


def _leaves_device(func, args, kwargs) -> bool:
    """A copy whose source is on an accelerator and whose destination is the host."""
    name = func._overloadpacket.__name__
    if name == "_to_copy":
        src, dev = args[0], kwargs.get("device")
        return src.device.type != "cpu" and dev is not None and torch.device(dev).type == "cpu"
    if name == "copy_":
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type != "cpu"
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: "SyncCounter") -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if name in _READS or name in _DATA_SHAPED or _leaves_device(func, args, kwargs):
            self.counter.add(name)
        elif name in _INDEX and len(args) > 1 and any(_is_bool_tensor(i) for i in (args[1] or ())):
            self.counter.add(f"{name}[bool]")
        elif name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and len(args) > 1 \
                and isinstance(args[1], torch.Tensor):
            self.counter.add(name)
        elif name in ("lift_fresh", "lift_fresh_copy") and args[0].dim() > 0:
            self.counter.uploads += 1           # a 0-dim one is a Python scalar: a fill on CUDA, no copy
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, counter: "SyncCounter") -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _FUNCTION_READS:
            self.counter.add(func.__name__)
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """`with SyncCounter() as c: ...` then c.total (host syncs), c.ops (Counter by op), c.uploads."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.uploads = 0
        self._modes: list = []

    def add(self, name: str) -> None:
        self.ops[name] += 1

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __enter__(self) -> "SyncCounter":
        self._modes = [_Function(self), _Dispatch(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)


@contextmanager
def count_calls(module: torch.nn.Module) -> Iterator[list[int]]:
    """Yields a one-element list holding the number of forward calls of `module` made inside the block."""
    calls = [0]

    def hook(*_args) -> None:
        calls[0] += 1
    handle = module.register_forward_pre_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()
