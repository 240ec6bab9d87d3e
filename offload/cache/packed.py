"""A layer cache written from layers already packed (made-up layers: `specexec bench stream`, the pager's tests),
through the same entries and manifest a build writes, opened by the runtime's own reader.

Does not know: checkpoints, quantizing, locks, resuming (offload/cache/store.py builds from a checkpoint).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from offload.cache.manifest import LAYERS_FILE, MANIFEST, VERSION
from offload.cache.store import LayerCache, _write_entry, _write_json
from offload.streaming.storage import LayerLayout


def write_packed(directory: str | os.PathLike, layers: Sequence[tuple[torch.Tensor, LayerLayout]],
                 options: dict) -> LayerCache:
    """A layer cache in `directory` (new or empty) from layers already packed (uint8 [nbytes], layout), with
    `options` in its manifest, opened: what a benchmark of made-up layers streams through the runtime's own
    reader. Nothing is quantized, checked against a checkpoint or locked."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    entries, offset = [], 0
    fd = os.open(path / LAYERS_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o644)
    try:
        for buf, layout in layers:
            entries.append(_write_entry(fd, buf, layout, offset))
            offset += layout.nbytes
        os.fsync(fd)
    finally:
        os.close(fd)
    _write_json(path / MANIFEST, dict(options, version=VERSION, file=LAYERS_FILE, file_nbytes=offset,
                                      layers=entries))
    return LayerCache.open(path)
