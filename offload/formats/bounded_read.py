"""Reading a file a user or a checkpoint names, whole but bounded: only a regular file (a FIFO or a device such as
/dev/zero never ends, or blocks until a writer comes), and at most MAX_BYTES of it (a stream: of what it sends),
so a name that points at the wrong thing ends in one line instead of filling memory or waiting forever.

Does not know: what the bytes mean (json_files.py parses JSON; the prompt readers decode text).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

MAX_BYTES = 256 << 20         # past any real config, index, saved chat or prompt (a 1M-token prompt is ~4 MB)


def too_large(what: str, limit: int) -> str:
    """The one line for input past `limit` bytes."""
    return f"{what} is larger than {limit / 2**20:g} MiB, more than any real one; pass a smaller one"


def read_bytes(path: str | os.PathLike, what: str, error: type[Exception] = ValueError,
               limit: int = MAX_BYTES) -> bytes:
    """The bytes of the regular file at `path` (symlinks followed); error(one line naming `what`) for anything
    else or a file over `limit` bytes. OSError (missing, unreadable, a directory) as raised: it names the file."""
    p = Path(path)
    mode = p.stat().st_mode
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):           # a directory: open's own "Is a directory"
        raise error(f"{what} is not a regular file (a device, FIFO or socket); name a file")
    with open(p, "rb") as f:
        return _bounded(f, what, error, limit)


def read_stream(stream: BinaryIO, what: str, error: type[Exception] = ValueError, limit: int = MAX_BYTES) -> bytes:
    """At most `limit` bytes of `stream` until its end; error(one line) when it sends more."""
    return _bounded(stream, what, error, limit)


CHUNK = 1 << 20                # read(n) allocates n bytes at once: the bound is counted chunk by chunk


def _bounded(f: BinaryIO, what: str, error: type[Exception], limit: int) -> bytes:
    chunks, total = [], 0
    while chunk := f.read(CHUNK):
        total += len(chunk)
        if total > limit:
            raise error(too_large(what, limit))
        chunks.append(chunk)
    return b"".join(chunks)
