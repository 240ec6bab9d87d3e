"""The disk tier of the prefix cache: one file per block of KV rows under <cache root>/prefix/<fingerprint>/,
bounded in bytes (least recently used files go first), checksummed, crash-safe.

A file is `SPXB1` + one JSON header line (its key, its parent's key, the block's token ids, the payload's
length and sha256) + the payload (torch.save of the block's tensors). It is written whole or not at all: a
temporary file in the same directory, flushed and fsync'ed, renamed into place (a killed writer leaves a
`.tmp` the next open removes). A file whose magic, header, ids or checksum do not match what was asked is
removed and reads as a miss, with one line to `warn`: nothing wrong is ever restored. A write that fails (a
full disk, a read-only directory) says so in one line and turns the tier's writes off for the run; reads go on.

Does not know: what the tensors are (specexec/kv/prefix_cache.py packs them), models, the engine.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

MAGIC = b"SPXB1\n"
SUFFIX = ".blk"


class DiskTier:
    """Blocks on disk in `directory`, at most `limit` bytes in all."""

    def __init__(self, directory: Path, limit: int, warn: Callable[[str], None], says: Path | None = None) -> None:
        self.directory, self.limit, self.warn = Path(directory), limit, warn
        self.says = Path(says) if says is not None else self.directory     # the folder a failure line names
        self.writable = True
        self.index: dict[str, tuple[int, float]] = {}       # key -> (bytes, last use)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for path in self.directory.iterdir():
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)             # a writer killed mid-write
                elif path.suffix == SUFFIX:
                    st = path.stat()
                    self.index[path.stem] = (st.st_size, st.st_mtime)
        except OSError as e:
            self._off(f"cannot use {self.says} ({e.strerror or e})")

    @property
    def nbytes(self) -> int:
        return sum(size for size, _ in self.index.values())

    def _off(self, why: str) -> None:
        if self.writable:
            self.warn(f"prompt cache: {why}; its disk tier writes nothing more this run (answers are unchanged)")
        self.writable = False

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def has(self, key: str) -> bool:
        return key in self.index

    def write(self, key: str, parent: str, ids: Sequence[int], tensors: list[torch.Tensor]) -> None:
        """Store one block (nothing when the tier is off or the block is already there)."""
        if not self.writable or key in self.index:
            return
        buf = io.BytesIO()
        torch.save([t.contiguous() for t in tensors], buf)
        payload = buf.getvalue()
        if len(payload) > self.limit:
            return
        header = json.dumps({"key": key, "parent": parent, "ids": list(ids), "bytes": len(payload),
                             "sha256": hashlib.sha256(payload).hexdigest()}).encode() + b"\n"
        self._evict(len(payload) + len(header) + len(MAGIC))
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.directory)
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + header)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(key))
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            self._off(f"cannot write {self.says} ({e.strerror or e})")
            return
        self.index[key] = (len(MAGIC) + len(header) + len(payload), time.time())

    def read(self, key: str, parent: str, ids: Sequence[int]) -> list[torch.Tensor] | None:
        """The block's tensors, or None: absent, or damaged (then removed, with one line)."""
        if key not in self.index:
            return None
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self.index.pop(key, None)
            return None
        tensors = self._parse(data, key, parent, ids)
        if tensors is None:
            self.warn(f"prompt cache: {path} is damaged (its checksum or header does not match); removed, the "
                      "prompt is computed again")
            self.index.pop(key, None)
            path.unlink(missing_ok=True)
            return None
        self.index[key] = (len(data), time.time())
        try:
            os.utime(path)
        except OSError:
            pass
        return tensors

    @staticmethod
    def _parse(data: bytes, key: str, parent: str, ids: Sequence[int]) -> list[torch.Tensor] | None:
        if not data.startswith(MAGIC):
            return None
        line_end = data.find(b"\n", len(MAGIC))
        try:
            header = json.loads(data[len(MAGIC):line_end])
        except ValueError:
            return None
        payload = data[line_end + 1:]
        if (not isinstance(header, dict) or header.get("key") != key or header.get("parent") != parent
                or header.get("ids") != list(ids) or header.get("bytes") != len(payload)
                or header.get("sha256") != hashlib.sha256(payload).hexdigest()):
            return None
        try:
            tensors = torch.load(io.BytesIO(payload), weights_only=True)
        except Exception:                    # noqa: BLE001 -- any unpickling failure is a damaged file
            return None
        return tensors if isinstance(tensors, list) and all(isinstance(t, torch.Tensor) for t in tensors) else None

    def _evict(self, need: int) -> None:
        """Remove least recently used files until `need` more bytes fit under the limit."""
        total = self.nbytes
        for key, (size, _) in sorted(self.index.items(), key=lambda kv: kv[1][1]):
            if total + need <= self.limit:
                break
            self.path(key).unlink(missing_ok=True)
            del self.index[key]
            total -= size
