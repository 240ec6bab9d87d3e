"""Read tensors from a Hugging Face safetensors checkpoint by name, without loading everything.

Handles a single `model.safetensors` or a sharded one (`model.safetensors.index.json`). Files are opened
lazily through safetensors' memory map, so reading one layer touches only that layer's bytes. Pickle
checkpoints (`*.bin`, `*.pt`) are never unpickled here: they are named in the error so the caller can decide.

Does not know: model architectures, tokens, or what the tensors mean.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from offload.formats.json_files import parse_json, weight_map

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.bin", "*.pt", "*.pth", "*.ckpt")
# safetensors header dtype codes -> torch dtypes (sizes planned from headers alone; AWQ/GPTQ stored dtypes)
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message says which file and why."""


def pickle_files(directory: Path) -> list[Path]:
    """Pickle-format weight files in `directory` (never opened)."""
    found: list[Path] = []
    for pattern in PICKLE_PATTERNS:
        found += [p for p in sorted(directory.glob(pattern)) if p not in found]
    return found


OUTSIDE_ENV = "SPECEXEC_ALLOW_OUTSIDE_SHARDS"      # set (to 1) by --allow-outside-shards


def allow_outside_shards() -> None:
    """Let weight files lie outside their checkpoint directory from now on (the user said they mean it)."""
    os.environ[OUTSIDE_ENV] = "1"


def shard_path(directory: Path, name: str, named_by: Path) -> Path:
    """directory/name, after CheckpointError unless it stays inside `directory` once symlinks are resolved (a
    Hugging Face cache snapshot's links into its repo's blobs/ count as inside) or $SPECEXEC_ALLOW_OUTSIDE_SHARDS
    is 1: a checkpoint's index or symlink must not make specexec open any file on the machine."""
    path = directory / name
    if os.environ.get(OUTSIDE_ENV) == "1":
        return path
    real = path.resolve()
    roots = [directory.resolve()]
    if directory.parent.name == "snapshots":          # <hub cache>/models--org--name/snapshots/<commit>/
        roots.append((directory.parent.parent / "blobs").resolve())
    if not any(real.is_relative_to(root) for root in roots):
        raise CheckpointError(f"{named_by} names the weight file {name!r}, which lies outside {directory} ({real}); "
                              "refused: pass --allow-outside-shards if you mean it")
    return path


class SafetensorsCheckpoint:
    """Name -> tensor access over one or more safetensors files."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self._handles: dict[Path, object] = {}
        self._where = self._index()          # tensor name -> file
        self._check_headers()

    def _index(self) -> dict[str, Path]:
        index, single = self.directory / INDEX, self.directory / SINGLE
        if index.is_file():
            where = {name: shard_path(self.directory, fname, index)
                     for name, fname in weight_map(index, CheckpointError).items()}
            for f in sorted(set(where.values())):
                if not f.is_file():
                    raise CheckpointError(f"{index} names the shard {f.name}, which is missing in {self.directory}")
            return where
        if single.is_file():
            shard_path(self.directory, SINGLE, single)
            return {name: single for name in self._open(single).keys()}
        pickles = pickle_files(self.directory)
        if pickles:
            raise CheckpointError(f"{self.directory} has only pickle weights ({pickles[0].name}); "
                                  "convert them to safetensors, or pass --allow-pickle to load them with "
                                  "torch.load(weights_only=True)")
        if single.is_symlink():                  # present but unreadable: say so, not "has no model.safetensors"
            raise CheckpointError(f"{single} is a symlink that leads nowhere (dangling, or a loop)")
        raise CheckpointError(f"{self.directory} has no {SINGLE} or {INDEX}")

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:        # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        return self._handles[path]

    def _check_headers(self) -> None:
        """Open every shard once and check it holds what the index says (truncated files fail here)."""
        for f in sorted(set(self._where.values())):
            names = set(self._open(f).keys())
            size = f.stat().st_size
            missing = [n for n, g in self._where.items() if g == f and n not in names]
            if missing:
                raise CheckpointError(f"{f.name} lacks {missing[0]!r}, which the index places there")
            end = _data_end(f)
            if end > size:
                raise CheckpointError(f"{f}: truncated ({size} bytes, the header needs {end})")

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._where[name]).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """One tensor as stored (CPU)."""
        if name not in self._where:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing")
        try:
            return self._open(self._where[name]).get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{self._where[name]}: cannot read {name!r} ({e})") from None

    def get_index(self, name: str, index: int) -> torch.Tensor:
        """tensor[index] along its first dimension (one expert of a fused tensor), reading only those bytes."""
        if name not in self._where:
            raise CheckpointError(f"{self.directory}: tensor {name!r} is missing")
        try:
            return self._open(self._where[name]).get_slice(name)[index:index + 1][0]
        except Exception as e:
            raise CheckpointError(f"{self._where[name]}: cannot read {name!r}[{index}] ({e})") from None

    def items(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in names if names is not None else self.names():
            yield name, self.get(name)


MAX_HEADER = 100 << 20                   # safetensors' own limit on a header's size


def read_header(path: Path, error: type[Exception] = CheckpointError) -> tuple[bytes, dict]:
    """(raw header bytes, parsed header) of a safetensors file; error(one line) when its length field or its
    JSON is not a real header's (a length past the file or 100 MB is never read)."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little")
        if len(head) < 8 or n > min(MAX_HEADER, max(path.stat().st_size - 8, 0)):
            raise error(f"{path}: not a safetensors file (its header length {n} does not fit the file)")
        raw = f.read(n)
    header = parse_json(raw, f"{path}'s safetensors header", error)
    if not isinstance(header, dict):
        raise error(f"{path}: its safetensors header is not a JSON object")
    return raw, header


def _data_end(path: Path) -> int:
    """Byte offset where the last tensor of a safetensors file ends, from its header."""
    raw, header = read_header(path, CheckpointError)
    n = len(raw)
    try:
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise CheckpointError(f"{path}: its safetensors header gives no data offsets") from None
    return 8 + n + max(ends, default=0)
