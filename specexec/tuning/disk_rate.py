"""How fast the disk under the layer cache reads, as `specexec doctor` measured it: the SSD rate a plan uses.

`specexec doctor` times a sequential O_DIRECT read in a directory (offload/platform/probe.py) and keeps the GB/s
here (`save_read_gbps`), one JSON file per file system (its device number) under <cache root>/disk/
(specexec/tuning/store.py). `measured_read_gbps(directory)` gives it back for the file system `directory` is on
(the cache root, where the layer cache is written), with when it was measured; None when doctor never measured
that disk, and the plan then says it assumes its default.

Does not know: how the read is timed (doctor, offload/platform/probe.py), what a plan does with the rate.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from specexec.tuning.store import read_json, store_path, write_json

KIND = "disk"


def _fingerprint(directory: Path) -> str | None:
    """The file system `directory` (or its nearest existing parent) lives on: its device number."""
    path = Path(directory).expanduser()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return f"dev-{os.stat(path).st_dev}"
    except OSError:
        return None


@dataclass(frozen=True)
class DiskRate:
    """A measured read rate: GB/s, the directory measured, when (UTC, ISO date)."""

    gbps: float
    directory: str
    when: str

    def said(self) -> str:
        return f"measured by `specexec doctor` on {self.when} in {self.directory}"


def save_read_gbps(directory: Path, gbps: float) -> None:
    """Keep doctor's measured sequential read rate of the file system `directory` is on."""
    fingerprint = _fingerprint(directory)
    if fingerprint is None or not gbps > 0:
        return
    write_json(store_path(KIND, fingerprint), {"fingerprint": fingerprint, "read_gbps": float(gbps),
                                               "directory": str(directory),
                                               "when": time.strftime("%Y-%m-%d", time.gmtime())})


def measured_read_gbps(directory: Path) -> DiskRate | None:
    """The rate doctor measured on the file system `directory` is on; None: never measured there."""
    fingerprint = _fingerprint(directory)
    data = read_json(store_path(KIND, fingerprint)) if fingerprint is not None else None
    if not data or data.get("fingerprint") != fingerprint:
        return None
    try:
        gbps = float(data["read_gbps"])
    except (KeyError, TypeError, ValueError):
        return None
    return DiskRate(gbps, str(data.get("directory", "")), str(data.get("when", "?"))) if gbps > 0 else None
