"""The prefix cache: KV rows of prompts computed before, in blocks of `block` tokens, found again by any later
prompt that begins with the same tokens, whichever request, chat session or server process computed them.

A block is named by a chained hash: key(i) = sha256(key(i-1) + the block's ids), key(-1) = the model's
fingerprint. A block's key so names its whole prefix (a radix tree over token ids in blocks, each node one
block), and a model other than the one that computed it (weights, dtype, quantization, KV format, device kind)
never finds it. Tiers: the engine's own cache holds the live prefix (the device tier); this cache keeps copies
of blocks in RAM (least recently used out first, at most `ram_bytes`) and, with a disk tier
(specexec/kv/prefix_disk.py), on disk too, so a restarted server or a new chat finds them.

What a block holds: every row group's stored tensors (K and V, or MLA's one latent row; int8 rows with their
scales) for the block's slots, bit for bit, so a restored row is the row that was computed. The API the engine
(or a batching scheduler, one cache per request) uses: `restore(ids, cache, keep)` -> the prefix length the
cache now holds (the longest cached prefix of `ids` in whole blocks, when longer than `keep`); `store(ids,
cache)` keeps the full blocks of `ids` the cache holds rows for. Caches it cannot serve (`unsupported`): rows
streamed to host RAM with their layer, and recurrent (linear-attention) layers, whose state would need the
snapshot at each block's end: those run as before.

Does not know: how rows were computed, trees, the engine, where the cache root is (the caller passes the
directory).
"""
from __future__ import annotations

import hashlib
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specexec.kv.cache import KVCache
from specexec.kv.prefix_disk import DiskTier

BLOCK = 64                      # tokens a block holds
RAM_CAP = 2 * 2**30             # the RAM tier's bytes at most, whatever the disk tier's size


def stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def block_keys(fingerprint: str, ids: Sequence[int], block: int) -> list[str]:
    """The chained key of each full block of `ids`."""
    keys, key = [], fingerprint
    for start in range(0, len(ids) - block + 1, block):
        h = hashlib.sha256(key.encode())
        h.update(torch.tensor(list(ids[start:start + block]), dtype=torch.int64).numpy().tobytes())
        key = h.hexdigest()[:40]
        keys.append(key)
    return keys


def unsupported(cache: KVCache) -> str | None:
    """Why the prefix cache cannot serve `cache` (None: it can)."""
    if cache.stream is not None:
        return "KV rows streamed to host RAM with their layers"
    if cache.stores:
        return "recurrent (linear-attention) layers"
    return None


class PrefixCache:
    """Blocks of KV rows of one model (see the module docstring). Counters: hits/misses (blocks restored or
    looked for in vain), stored (blocks kept)."""

    def __init__(self, fingerprint: str, limit: int, directory: Path | None = None, block: int = BLOCK,
                 warn: Callable[[str], None] = stderr_line, says: Path | None = None) -> None:
        self.fingerprint, self.block, self.warn = fingerprint, block, warn
        self.ram_bytes = min(limit, RAM_CAP)
        self.ram: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
        self.disk = DiskTier(directory, limit, warn, says) if directory is not None else None
        self.hits = self.misses = self.stored = 0
        self._said: set[str] = set()
        self._lock = threading.RLock()           # seats of one server restore and store from their own threads

    @property
    def ram_used(self) -> int:
        return sum(t.nbytes for ts in self.ram.values() for t in ts)

    def usable(self, cache: KVCache) -> bool:
        """Whether `cache` can be served (said once per reason when not)."""
        why = unsupported(cache)
        if why is not None and why not in self._said:
            self._said.add(why)
            self.warn(f"prompt cache: off for this model ({why}); prompts are computed as before")
        return why is None

    # ------------------------------------------------------------------------------------- lookup

    def _get(self, key: str, parent: str, ids: Sequence[int]) -> list[torch.Tensor] | None:
        tensors = self.ram.get(key)
        if tensors is not None:
            self.ram.move_to_end(key)
            return tensors
        if self.disk is None:
            return None
        tensors = self.disk.read(key, parent, ids)
        if tensors is not None:
            self._remember(key, tensors)
        return tensors

    def cached(self, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` the cache holds rows for (whole blocks; RAM or disk)."""
        with self._lock:
            return self._cached(ids)

    def _cached(self, ids: Sequence[int]) -> int:
        n = 0
        for key in block_keys(self.fingerprint, ids, self.block):
            if key not in self.ram and not (self.disk is not None and self.disk.has(key)):
                break
            n += self.block
        return n

    def restore(self, ids: Sequence[int], cache: KVCache, keep: int) -> int:
        """Restore into `cache` (which holds `keep` rows of `ids`' prefix) the longest cached prefix of `ids` in
        whole blocks when it is longer than `keep`; -> the prefix length the cache holds now."""
        if not self.usable(cache):
            return keep
        with self._lock:
            return self._restore(ids, cache, keep)

    def _restore(self, ids: Sequence[int], cache: KVCache, keep: int) -> int:
        keys = block_keys(self.fingerprint, ids, self.block)
        start = keep // self.block                  # blocks the cache already holds whole
        found: list[list[torch.Tensor]] = []
        parent = keys[start - 1] if start else self.fingerprint
        for i in range(start, len(keys)):
            tensors = self._get(keys[i], parent, ids[i * self.block:(i + 1) * self.block])
            if tensors is None or not self._fits(tensors, cache):
                break
            found.append(tensors)
            parent = keys[i]
        if (start + len(found)) * self.block <= keep:
            self.misses += int(start < len(keys))
            return keep
        at = start * self.block
        cache.truncate(at)
        for tensors in found:
            self._put(cache, at, tensors)
            at += self.block
        cache.advance(at - cache.length)
        self.hits += len(found)
        return cache.length

    @staticmethod
    def _fits(tensors: list[torch.Tensor], cache: KVCache) -> bool:
        parts = [p for g in cache.row_groups for p in g.parts()]
        return len(parts) == len(tensors) and all(t.shape[0] == p.shape[0] and t.shape[2:] == p.shape[2:]
                                                  and t.dtype == p.dtype for t, p in zip(tensors, parts))

    def _put(self, cache: KVCache, at: int, tensors: list[torch.Tensor]) -> None:
        parts = [p for g in cache.row_groups for p in g.parts()]
        for t, p in zip(tensors, parts):
            p[:, at:at + self.block] = t.to(p.device, non_blocking=True)

    # ------------------------------------------------------------------------------------- store

    def store(self, ids: Sequence[int], cache: KVCache) -> int:
        """Keep the full blocks of `ids` whose rows `cache` holds and this cache lacks; -> blocks kept."""
        if not self.usable(cache):
            return 0
        with self._lock:
            return self._store(ids, cache)

    def _store(self, ids: Sequence[int], cache: KVCache) -> int:
        keys = block_keys(self.fingerprint, ids[:cache.length], self.block)
        new = 0
        parent = self.fingerprint
        for i, key in enumerate(keys):
            on_disk = self.disk is not None and (self.disk.has(key) or not self.disk.writable)
            if key in self.ram and (self.disk is None or on_disk):
                self.ram.move_to_end(key)
            else:
                at = i * self.block
                tensors = self.ram.get(key) or [p[:, at:at + self.block].to("cpu", copy=True)
                                                for g in cache.row_groups for p in g.parts()]
                self._remember(key, tensors)
                if self.disk is not None:
                    self.disk.write(key, parent, ids[at:at + self.block], tensors)
                new += 1
            parent = key
        self.stored += new
        return new

    def _remember(self, key: str, tensors: list[torch.Tensor]) -> None:
        self.ram[key] = tensors
        self.ram.move_to_end(key)
        used = self.ram_used
        while used > self.ram_bytes and len(self.ram) > 1:
            _, dropped = self.ram.popitem(last=False)
            used -= sum(t.nbytes for t in dropped)

    def summary(self) -> dict:
        return {"block": self.block, "hits": self.hits, "misses": self.misses, "stored": self.stored,
                "ram_blocks": len(self.ram), "ram_bytes": self.ram_used,
                "disk_bytes": self.disk.nbytes if self.disk is not None else 0}
