"""Host data onto the device without a host sync: `upload` copies a Python list (node indices, slots) from pinned
host memory with non_blocking=True, so the host goes on while the copy waits its turn on the stream (CUDA's
caching host allocator keeps the pinned source until the copy has run). A blocking copy, `torch.tensor(list,
device=cuda)` or `key.new_tensor(x)` included, would wait for every kernel queued before it. On a CPU it is a
plain tensor.

Does not know: what the values mean.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def upload(values: Sequence[int] | Sequence[float], device: torch.device | str,
           dtype: torch.dtype = torch.long) -> Tensor:
    """values [n] as a `dtype` tensor on `device`, copied without waiting for the device."""
    device = torch.device(device)
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
