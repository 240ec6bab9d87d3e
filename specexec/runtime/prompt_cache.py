"""`--prompt-cache SIZE`: a Runtime's prefix cache (specexec/kv/prefix_cache.py) keyed by what its target's KV rows
depend on, its disk tier under <cache root>/prefix/<fingerprint>/; a draft model's rows in one of its own
(<fingerprint>/draft-<its fingerprint>/), so neither model recomputes a prompt the cache holds.

The fingerprint hashes the target checkpoint (its resolved path, and each file's name, size and modification
time), its ModelArgs, the run dtype, the offload plan's weight format (int4 rows are not fp16 rows), the KV
format and the device kind: a cache written by another model, quantization or machine kind is never read.

Does not know: how blocks are stored or restored (specexec/kv/), HTTP, the command line.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from specexec.kv.prefix_cache import PrefixCache, stderr_line
from specexec.tuning.store import cache_dir


def kv_fingerprint(runtime, draft: bool = False) -> str:
    """What a Runtime's target (draft: its draft model's) KV rows depend on, hashed (see the module docstring)."""
    info = runtime.draft_info if draft else runtime.target_info
    path = Path(info.path)
    files = []
    if path.is_dir():
        for f in sorted(path.iterdir()):
            if f.is_file():
                st = f.stat()
                files.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    engine = runtime.engine
    fmt = getattr(runtime.plan, "fmt", None) if runtime.plan is not None and not draft else None
    kv = engine.draft_kv_quant if draft else runtime.config.kv_quant
    parts = [str(path.resolve()), *files, repr(info.args), str(info.dtype), str(fmt), str(kv),
             str(engine.device.type), "draft" if draft else "target"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def attach(runtime, limit: int, directory: Path | None | str = "auto",
           warn: Callable[[str], None] = stderr_line) -> PrefixCache:
    """Give `runtime`'s engine a prefix cache of at most `limit` bytes (and its draft model one of its own, under
    the draft's fingerprint); directory "auto": the disk tier under the cache root, None: RAM only; a directory
    given holds the target's blocks, the draft's a folder in it named after the draft's fingerprint. Each model's
    tier holds at most `limit` bytes; a line said by both is said once."""
    said: set[str] = set()

    def once(line: str) -> None:
        if line not in said:
            said.add(line)
            warn(line)
    fingerprint = kv_fingerprint(runtime)
    where = cache_dir("prefix") / fingerprint if directory == "auto" else directory
    cache = PrefixCache(fingerprint, limit, Path(where) if where is not None else None, warn=once)
    runtime.engine.prefix_cache = cache
    feed = runtime.engine.feed
    if hasattr(feed, "prefix_cache") and runtime.draft_info is not None:        # a draft model (ModelFeed)
        draft_fp = kv_fingerprint(runtime, draft=True)
        draft_dir = None if where is None else Path(where) / f"draft-{draft_fp}"
        feed.prefix_cache = PrefixCache(draft_fp, limit, draft_dir, warn=once, says=where)
    return cache
