"""One JSON file per fingerprint under the one cache root: where measurements persist between runs.
`--budget auto`'s target pass costs live in costs/, a pair's acceptance vectors in acceptance/, VocabTrim's
token counts in vocab/ (and `specexec demo` keeps its models in demo/ beside them). The root is the one every
cache of specexec uses: cpu_kernels.cache_root.default_cache_root ($SPECEXEC_CACHE, else
$XDG_CACHE_HOME/specexec, else ~/.cache/specexec).

A file is written whole or not at all (a temporary file in the same directory, renamed into place); a file
that is absent, unreadable or not a JSON object reads as None, so the caller measures again: a damaged cache
is neither trusted nor fatal.

Does not know: what a file holds (each caller's format) or what a fingerprint is made of (the callers hash
what their measurement depends on).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from cpu_kernels.cache_root import default_cache_root


def cache_dir(kind: str) -> Path:
    """The directory of one kind of cached thing under the cache root (e.g. "costs", "demo")."""
    return default_cache_root() / kind


def store_path(kind: str, fingerprint: str) -> Path:
    """The JSON file of one fingerprint of one kind: <cache root>/<kind>/<fingerprint>.json."""
    return cache_dir(kind) / f"{fingerprint}.json"


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`; None when it is absent, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: dict, indent: int | None = None) -> None:
    """Write `data` to `path` atomically (its directory made as needed); a concurrent writer of the same file
    leaves one whole file, never a mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=indent))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
