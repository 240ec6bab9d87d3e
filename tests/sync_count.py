"""Count host synchronisations as a CPU test, the way CUDA's sync debug mode (torch.cuda.set_sync_debug_mode) would
count them on a GPU: the ops whose result the host must wait for, and the host-to-device copies that block.

`SyncCounter` is a context manager (a TorchDispatchMode plus a TorchFunctionMode) that counts, on any device:
- reads of tensor data into Python: `item`/`int()`/`float()`/`bool()`/`if t:` (aten item, _local_scalar_dense,
  is_nonzero), `tolist()`, `numpy()`, `torch.equal`/`allclose`;
- ops whose output shape depends on the data: `nonzero`/`argwhere`, `masked_select`, boolean-mask indexing
  (`x[mask]`, `x[mask] = y`), `unique`, `repeat_interleave` with tensor repeats;
- copies from a device to the host (`.cpu()`, `.to("cpu")`; none on a CPU-only run);
- blocking host-to-device copies, which CUDA's copy waits for (`memcpy_and_sync`): a tensor made from Python data
  on the device (`torch.tensor(data, device=d)`, `torch.as_tensor(data, device=d)`, `t.new_tensor(data)` of a
  device tensor `t`, 0-dim ones too: `key.new_tensor(float("-inf"))`), a host tensor moved to the device without
  `non_blocking=True` (`.to(d)`, `.cuda()`, `copy_`), and indexing a device tensor with a Python list or a host
  tensor (`x[[1, 2]]`, `x[idx_on_host] = y`: CUDA copies the index over first).
Which tensors are the host's: those made from Python data or by a factory (`zeros`, `arange`, ...) without a
`device`, and what ops compute from them alone. Python scalars (`x[0] = 1.0`, `torch.where(m, x, 0.0)`) and
factories given a device are fills on CUDA: not counted. A host tensor moved with `non_blocking=True` is not
counted (on CUDA the code must then pin it: pinning is not visible on a CPU).

`uploads` counts the tensors made from Python data with at least one dimension (lift_fresh): on CUDA each is a
host-to-device copy, blocking or not (a 0-dim one from a Python scalar is a fill there, no copy).
`ops` says which op each sync came from ("upload:tensor", "upload:to", "index[list]", ...).

`count_calls(module)` counts forward calls of a module (e.g. the draft: its draft passes).

Does not know: specexec; it only watches torch ops. On a CPU run every device is the CPU: a tensor made with an
explicit device is taken to be the device's, even when that device is meant to be the host.
"""
from __future__ import annotations

import weakref
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
_FROM_DATA = {"tensor", "as_tensor", "asarray"}
_FACTORIES = {"zeros", "ones", "empty", "full", "arange", "range", "linspace", "eye", "rand", "randn", "randint",
              "randperm", "tril_indices", "triu_indices"}
_MOVES = {"to", "cuda", "copy_"}
_INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}


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
        if self.counter.on_host(args):
            pass                                # the host's own tensors: nothing to wait for
        elif name in _READS or name in _DATA_SHAPED or _leaves_device(func, args, kwargs):
            self.counter.add(name)
        elif name in _INDEX and len(args) > 1 and any(_is_bool_tensor(i) for i in (args[1] or ())):
            self.counter.add(f"{name}[bool]")
        elif name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and len(args) > 1 \
                and isinstance(args[1], torch.Tensor):
            self.counter.add(name)
        elif name in ("lift_fresh", "lift_fresh_copy") and args[0].dim() > 0:
            self.counter.uploads += 1           # a 0-dim one is a Python scalar: a fill on CUDA, no copy
        return func(*args, **kwargs)


_NESTED = (list, tuple, dict)


def _tensors(obj: object) -> list[torch.Tensor]:
    """Every tensor in `obj` and in the lists, tuples and dict values nested in it."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    found: list[torch.Tensor] = []
    if isinstance(obj, _NESTED):
        _collect(obj, found)
    return found


def _collect(items: list | tuple | dict, found: list[torch.Tensor]) -> None:
    for x in items.values() if isinstance(items, dict) else items:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, _NESTED):
            _collect(x, found)


def _has_list(index: object) -> bool:
    """An index with a Python list (or a tuple holding one): CUDA turns it into a tensor and copies it over."""
    if isinstance(index, list):
        return True
    return isinstance(index, tuple) and any(isinstance(i, list) for i in index)


def _moves_to_device(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a `to`/`cuda`/`copy_` call names a device (or a tensor) to move to."""
    if name in ("cuda", "copy_"):
        return True
    targets = list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]
    return any(isinstance(t, (torch.device, torch.Tensor)) or (isinstance(t, str) and t not in ("",)) for t in targets
               if t is not None and not isinstance(t, torch.dtype))


class _Function(TorchFunctionMode):
    def __init__(self, counter: "SyncCounter") -> None:
        super().__init__()
        self.counter = counter
        self.host = counter.host

    def _is_host(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self.host

    def _mark(self, t: torch.Tensor) -> None:
        if id(t) not in self.host:
            self.host.add(id(t))
            weakref.finalize(t, self.host.discard, id(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _FUNCTION_READS and not self._is_host(args[0] if args else None):
            self.counter.add(name)
        where = self._before(name, args, kwargs)
        out = func(*args, **kwargs)
        for t in _tensors(out) if where is not None else ():
            if where == "host":
                self._mark(t)
            else:                               # moved: on a CPU `.to` may hand back the very same tensor
                self.host.discard(id(t))
        return out

    def _before(self, name: str, args: tuple, kwargs: dict) -> str | None:
        """Count what this call would copy to the device and block on; where its output lives: "host",
        "device" (a move), or None (the device, nothing to note)."""
        if name in _FROM_DATA:
            data = args[0] if args else kwargs.get("data")
            if isinstance(data, torch.Tensor):                  # as_tensor(t, device=...): a move
                if kwargs.get("device") is not None and self._is_host(data):
                    self.counter.add("upload:as_tensor")
                return "host" if self._is_host(data) and kwargs.get("device") is None else None
            if kwargs.get("device") is not None:
                self.counter.add(f"upload:{name}")
                return None
            return "host"
        if name == "new_tensor":
            if self._is_host(args[0]) and kwargs.get("device") is None:
                return "host"
            self.counter.add("upload:new_tensor")
            return None
        if name in _FACTORIES:
            return "host" if kwargs.get("device") is None else None
        if name in _MOVES and args and isinstance(args[0], torch.Tensor):
            src = args[1] if name == "copy_" else args[0]
            moving = _moves_to_device(name, args, kwargs)
            if name == "copy_":
                moving = self._is_host(src) and not self._is_host(args[0])
            if moving and self._is_host(src) and not kwargs.get("non_blocking", False):
                self.counter.add(f"upload:{name}")
            if moving:
                return "device"
            return "host" if self._is_host(src) else None
        if name in _INDEXING and len(args) > 1 and not self._is_host(args[0]):
            index = args[1]
            if _has_list(index) or any(self._is_host(t) and t.dim() > 0 for t in _tensors(index)):
                self.counter.add("index[list]")
            return None
        inputs = False                          # "host" when there are inputs with a dimension, all the host's
        for t in _tensors(args) + _tensors(kwargs) if kwargs else _tensors(args):
            if t.dim() > 0:
                if id(t) not in self.host:
                    return None
                inputs = True
        return "host" if inputs else None


class SyncCounter:
    """`with SyncCounter() as c: ...` then c.total (host syncs, the CUDA way), c.ops (Counter by op), c.uploads."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.uploads = 0
        self.host: set[int] = set()            # ids of the host's tensors (dropped when a tensor is freed)
        self._modes: list = []

    def on_host(self, args: tuple) -> bool:
        """Every tensor among `args` (with data) is the host's: reading it waits for nothing."""
        tensors = list(_tensors(args))
        return bool(tensors) and all(id(t) in self.host for t in tensors)

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
