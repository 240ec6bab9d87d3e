"""A layer cache's build journal: what lets a killed or interrupted build resume where it stopped.

A build writes into a temporary directory beside the final one (offload/cache/store.py). Beside its layers.bin it
keeps `journal.jsonl`: a first line naming what is being built (the sha256 of the expected options and source
fingerprint), then one line per layer written (its manifest entry: offset, nbytes, sha256, layout), appended after
the layer's bytes were handed to the file. The next builder of the same cache (holding the same lock) adopts such
a directory left by a dead or interrupted process: a layer is kept when its journal line matches the planned
layout at the planned offset and the bytes on disk still hash to its sha256 (so a line that outlived its bytes in
a power cut costs that layer again, never a wrong one); the build goes on from the first layer not kept.

Does not know: how layers are quantized or packed, the lock, the manifest's checks.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from offload.platform.facilities import pread_into
from offload.streaming.storage import LayerLayout

JOURNAL = "journal.jsonl"
_TEMP_MARK = ".tmp-"            # a builder's temporary directory: .<final name>.tmp-<pid>


def build_key(expect: dict) -> str:
    """What a journal's first line names: the sha256 of the expected options and source fingerprint."""
    return hashlib.sha256(json.dumps(expect, sort_keys=True).encode()).hexdigest()


class Journal:
    """The journal of the build in directory `tmp` (opened for appending; `start` writes its first line)."""

    def __init__(self, tmp: Path, expect: dict) -> None:
        self.path = tmp / JOURNAL
        self.key = build_key(expect)
        self._f = None

    def start(self, kept: Sequence[dict]) -> None:
        """(Re)write the journal: its key, then the entries of the layers kept from an adopted build."""
        with open(self.path, "w") as f:
            f.write(json.dumps({"build": self.key}) + "\n")
            for e in kept:
                f.write(json.dumps(e) + "\n")
        self._f = open(self.path, "a")

    def add(self, entry: dict) -> None:
        """One more layer written: its manifest entry, flushed to the file (not fsynced: a resume checks the bytes)."""
        self._f.write(json.dumps(entry) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_entries(tmp: Path, expect: dict) -> list[dict]:
    """The layer entries journaled in `tmp` for this very build (expect), in order, up to the first unreadable line;
    [] when there is no journal or it names another build."""
    try:
        lines = (tmp / JOURNAL).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    try:
        if not lines or json.loads(lines[0]).get("build") != build_key(expect):
            return []
    except (ValueError, AttributeError):
        return []
    out = []
    for line in lines[1:]:
        try:
            entry = json.loads(line)
        except ValueError:
            break                                  # a torn last line: the layers before it stand
        if not isinstance(entry, dict):
            break
        out.append(entry)
    return out


def adopt(final: Path, tmp: Path, expect: dict) -> bool:
    """Rename the leftover build directory of `final` with the most journaled layers of this build to `tmp` (the
    lock is held, so its builder is gone); whether one was adopted. Others stay for the caller to remove."""
    best, most = None, 0
    for p in final.parent.glob(f".{final.name}{_TEMP_MARK}*"):
        n = len(read_entries(p, expect)) if p.is_dir() else 0
        if n > most:
            best, most = p, n
    if best is None:
        return False
    if best != tmp:
        os.rename(best, tmp)
    return True


def kept_layers(fd: int, entries: Sequence[dict], layouts: Sequence[LayerLayout]) -> list[dict]:
    """The leading entries whose layer stands in the file open at `fd`: its planned layout at its planned offset,
    and the bytes there hash to its sha256 (and its regions' to theirs)."""
    kept, offset = [], 0
    size = os.fstat(fd).st_size
    for entry, layout in zip(entries, layouts):
        if (entry.get("offset") != offset or entry.get("nbytes") != layout.nbytes
                or entry.get("layout") != layout.to_dict() or offset + layout.nbytes > size):
            break
        buf = bytearray(layout.nbytes)
        if _read_fully(fd, memoryview(buf), offset) != layout.nbytes:
            break
        if hashlib.sha256(buf).hexdigest() != entry.get("sha256"):
            break
        kept.append(entry)
        offset += layout.nbytes
    return kept


def _read_fully(fd: int, view: memoryview, offset: int) -> int:
    """Read len(view) bytes at `offset` (looping over short reads); the count read (less only at end of file)."""
    done = 0
    while done < len(view):
        n = pread_into(fd, view[done:], offset + done)
        if n <= 0:
            break
        done += n
    return done
