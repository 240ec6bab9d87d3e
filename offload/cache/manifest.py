"""The layer cache's manifest: its errors, file names, and the checks every open makes without reading a layer.

A cache directory holds layers.bin and manifest.json (see offload/cache/store.py). Opening checks, from metadata
alone: the manifest parses and has every field, the version, the options and source fingerprint the caller
expects, offsets that tile the file, and the file's exact size; and that no reader marked the cache corrupt
(a layer that failed its checksum when first read leaves a CORRUPT file naming it, so the next open rebuilds).

Does not know: how layers are read or checksummed (cache_reading.py), how caches are built (cache.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from offload.streaming.storage import ALIGN, LayerLayout

VERSION = 1
LAYERS_FILE = "layers.bin"
MANIFEST = "manifest.json"
CORRUPT = "CORRUPT"            # written next to the manifest by the reader that found a bad checksum


class CacheError(ValueError):
    """A layer cache that cannot be built or used; the message names the path and the reason."""


class CacheCorruptError(CacheError):
    """A cache whose bytes or manifest do not match what was written (checksum, size, garbled manifest)."""


def load_manifest(path: Path) -> dict:
    """The manifest of cache dir `path`, checked for shape and against the file's size (no layer is read)."""
    mpath, fpath = path / MANIFEST, path / LAYERS_FILE
    if not mpath.is_file() or not fpath.is_file():
        raise CacheError(f"{path} is not a layer cache (no {MANIFEST} or {LAYERS_FILE})")
    if (path / CORRUPT).is_file():
        why = (path / CORRUPT).read_text(errors="replace").strip()
        raise CacheCorruptError(f"{path} was found corrupt by an earlier run ({why})")
    try:
        manifest = json.loads(mpath.read_text())
        layers = manifest["layers"]
        layouts = [LayerLayout.from_dict(e["layout"]) for e in layers]
        offsets = [int(e["offset"]) for e in layers]
        size = int(manifest["file_nbytes"])
        _ = [str(e["sha256"]) for e in layers]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CacheCorruptError(f"{mpath} is not a valid manifest ({type(e).__name__}: {e})") from None
    if manifest.get("version") != VERSION:
        raise CacheError(f"{path} was written by cache version {manifest.get('version')}, this is {VERSION}")
    expected = 0
    for i, (off, lay) in enumerate(zip(offsets, layouts)):
        if off != expected or off % ALIGN:
            raise CacheCorruptError(f"{mpath}: layer {i} at offset {off}, expected {expected}")
        expected = off + lay.nbytes
    actual = fpath.stat().st_size
    if expected != size or actual != size:
        raise CacheCorruptError(f"{fpath} has {actual} bytes, the manifest expects {size} (layers end at {expected}); "
                                "the cache is truncated or overwritten")
    return manifest


def check_expected(path: Path, manifest: dict, expect: dict) -> None:
    """CacheError when the manifest was built from other source files or with other options (stale)."""
    for key, want in expect.items():
        if manifest.get(key) != want:
            what = (fingerprint_change(manifest.get(key), want) if key == "fingerprint" else
                    f"its {key} differs since it was built")
            raise CacheError(f"{path} is stale: {what}")


def fingerprint_change(built: list, now: list) -> str:
    """What differs between a cache's recorded fingerprint and the checkpoint's now, in words."""
    if not isinstance(built, list):
        return "the checkpoint's files changed since it was built"
    old = {e[0]: e for e in built if isinstance(e, list) and e}
    for entry in now:
        before = old.pop(entry[0], None)
        if before is None:
            return f"{entry[0]} is new since it was built"
        if before == entry:
            continue
        if before[1:3] == entry[1:3] and len(before) == len(entry):
            return (f"{entry[0]}'s bytes changed since it was built, though its size and modification time did not "
                    "(the file was swapped)")
        return f"{entry[0]} changed since it was built"
    return f"{next(iter(old))} is gone since it was built" if old else "the checkpoint's files changed since it was built"


def mark_corrupt(path: Path, why: str) -> None:
    """Leave a CORRUPT file in cache dir `path` so the next open rebuilds it (best effort: a read-only cache
    directory keeps failing on first read instead, with the same message)."""
    try:
        tmp = path / f".{CORRUPT}.{os.getpid()}"
        tmp.write_text(why + "\n")
        os.replace(tmp, path / CORRUPT)
    except OSError:
        pass
