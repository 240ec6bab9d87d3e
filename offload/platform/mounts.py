"""Which file system a path lives on, from the mount table (/proc/mounts, where it exists), to warn about the
WSL2 trap: Windows drives (/mnt/c, ...) are 9p mounts ("drvfs"), which read several times slower than the Linux
file system, so a layer cache or a model kept there makes every streamed pass or load crawl.

Does not know: plans, caches or models (callers pass paths and put the warnings where the user sees them).
"""
from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath

MOUNTS = Path("/proc/mounts")
SLOW_TYPES = frozenset({"9p", "drvfs", "v9fs"})
LINUX_CACHE = "~/.cache/specexec"


def mount_of(path: str | os.PathLike, mounts: Path | None = None) -> tuple[str, str] | None:
    """(mount point, file-system type) of the mount that holds `path` (symlinks resolved; the path need not
    exist): the longest mount point that contains it, the last one listed when mounts are stacked. `mounts`:
    the mount table (default MOUNTS, /proc/mounts); None without a readable one (Windows, macOS)."""
    try:
        lines = (mounts or MOUNTS).read_text(errors="replace").splitlines()
    except OSError:
        return None
    target = PurePosixPath(Path(path).expanduser().resolve())
    best: tuple[int, str, str] | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = PurePosixPath(_unescape(fields[1]))
        if (point == target or point in target.parents) and (best is None or len(point.parts) >= best[0]):
            best = (len(point.parts), str(point), fields[2])
    return None if best is None else (best[1], best[2])


def _unescape(field: str) -> str:
    """/proc/mounts writes a space as \\040, a tab as \\011, a newline as \\012, a backslash as \\134."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def slow_mount_warnings(model: str | os.PathLike | None, cache_root: str | os.PathLike | None,
                        mounts: Path | None = None) -> tuple[str, ...]:
    """One line per path (the model, the layer cache root; None: not used) that lies on a 9p/drvfs mount,
    saying what to do instead."""
    out = []
    for path, what, advice in (
            (model, "the model", "keep models on the Linux side, e.g. HF_HOME=~/.cache/huggingface, or copy "
                                 "the checkpoint under ~"),
            (cache_root, "the layer cache", f"point SPECEXEC_CACHE (or --cache-dir) at a Linux-side path "
                                            f"such as {LINUX_CACHE}")):
        found = mount_of(path, mounts) if path is not None else None
        if found is not None and found[1] in SLOW_TYPES:
            out.append(f"{what} {path} is on a {found[1]} mount ({found[0]}: in WSL2 a Windows drive), which "
                       f"reads several times slower than the Linux file system; {advice}")
    return tuple(out)
