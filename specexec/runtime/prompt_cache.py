"""`--prompt-cache SIZE`: a Runtime's prefix cache (specexec/kv/prefix_cache.py) keyed by what its target's KV rows
depend on, its disk tier under <cache root>/prefix/<fingerprint>/.

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


def kv_fingerprint(runtime) -> str:
    """What a Runtime's target KV rows depend on, hashed (see the module docstring)."""
    info = runtime.target_info
    path = Path(info.path)
    files = []
    if path.is_dir():
        for f in sorted(path.iterdir()):
            if f.is_file():
                st = f.stat()
                files.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    fmt = getattr(runtime.plan, "fmt", None) if runtime.plan is not None else None
    config = runtime.config
    parts = [str(path.resolve()), *files, repr(info.args), str(info.dtype), str(fmt), str(config.kv_quant),
             str(runtime.engine.device.type)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def attach(runtime, limit: int, directory: Path | None | str = "auto",
           warn: Callable[[str], None] = stderr_line) -> PrefixCache:
    """Give `runtime`'s engine a prefix cache of at most `limit` bytes; directory "auto": the disk tier under the
    cache root, None: RAM only."""
    fingerprint = kv_fingerprint(runtime)
    where = cache_dir("prefix") / fingerprint if directory == "auto" else directory
    cache = PrefixCache(fingerprint, limit, Path(where) if where is not None else None, warn=warn)
    runtime.engine.prefix_cache = cache
    return cache
