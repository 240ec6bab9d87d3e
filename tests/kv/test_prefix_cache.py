"""The prefix cache (specexec/kv/prefix_cache.py, prefix_disk.py, specexec/runtime/prompt_cache.py) on the tiny
pair, fp32 greedy: a prompt computed once is found again by a later request after another prompt took the
engine's cache, by a restarted process (a new cache over the same directory: the disk tier) and by a prompt
that only begins with it; each hit gives the cold run's ids and counts its tokens as reused. A damaged file
is one line, removed, and recomputed; a disk that refuses writes is one line and generation goes on; the disk
tier stays under its size; another model never finds the blocks."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from specexec.config import EngineConfig
from specexec.kv.prefix_cache import PrefixCache, block_keys
from specexec.runtime import prompt_cache
from specexec.runtime.assembly import Runtime

BLOCK = 16
PROMPT = [int(x) for x in torch.randint(3, 250, (90,), generator=torch.Generator().manual_seed(5))]
OTHER = [int(x) for x in torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(6))]
NEW = 12


@pytest.fixture(scope="module")
def runtime(tiny_pair, tiny_perturbed_draft):
    return Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft),
                        EngineConfig(budget=8, dtype="float32", max_new_tokens=NEW))


def _cache(runtime, tmp_path, lines: list[str], limit: int = 2**30) -> PrefixCache:
    cache = prompt_cache.attach(runtime, limit, tmp_path / "prefix", warn=lines.append)
    cache.block = BLOCK
    return cache


def _run(runtime, prompt: list[int]) -> tuple[list[int], int]:
    ids = [t for step in runtime.generate_ids(prompt, NEW) for t in step]
    return ids, runtime.engine.stats.reused_tokens


def _cold(runtime, prompt: list[int]) -> list[int]:
    runtime.engine.prefix_cache = None
    _run(runtime, OTHER)                                  # the engine's own cache holds another prompt
    return _run(runtime, prompt)[0]


def test_hits_after_another_prompt_after_a_restart_and_for_a_longer_prompt_are_exact(runtime, tmp_path) -> None:
    cold = _cold(runtime, PROMPT)
    longer = PROMPT + OTHER[:20]
    cold_longer = _cold(runtime, longer)
    lines: list[str] = []
    cache = _cache(runtime, tmp_path, lines)
    _run(runtime, OTHER)
    cache.stored = 0
    assert _run(runtime, PROMPT) == (cold, 0) and cache.stored == (len(PROMPT) - 1) // BLOCK
    _run(runtime, OTHER)                                  # the live prefix is gone (OTHER's blocks hit)
    cache.hits = 0
    ids, reused = _run(runtime, PROMPT)
    assert ids == cold and reused == (len(PROMPT) - 1) // BLOCK * BLOCK and cache.hits == 5
    assert runtime.engine.feed.prefix_cache.hits >= 1                    # the draft's rows came back too

    restarted = _cache(runtime, tmp_path, lines)           # a new process: nothing in RAM, the same directory
    _run(runtime, OTHER)
    keys = block_keys(restarted.fingerprint, PROMPT, BLOCK)
    assert not set(keys) & set(restarted.ram) and restarted.cached(PROMPT) == 80     # on disk only
    ids, reused = _run(runtime, longer)
    assert ids == cold_longer and reused == 80 and lines == []


def test_a_damaged_file_is_one_line_and_recomputed(runtime, tmp_path) -> None:
    cold = _cold(runtime, PROMPT)
    lines: list[str] = []
    _cache(runtime, tmp_path, lines)
    _run(runtime, PROMPT)
    keys = block_keys(prompt_cache.kv_fingerprint(runtime), PROMPT, BLOCK)
    path = tmp_path / "prefix" / f"{keys[2]}.blk"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40                                      # one bit of the rows
    path.write_bytes(bytes(data))
    _cache(runtime, tmp_path, lines)                      # restart: blocks 0, 1 good, 2 damaged
    _run(runtime, OTHER)
    ids, reused = _run(runtime, PROMPT)
    assert ids == cold and reused == 2 * BLOCK
    assert len(lines) == 1 and "damaged" in lines[0] and str(path) in lines[0], lines
    assert path.exists()                                  # written again by the recomputing run


def test_a_full_disk_is_one_line_and_generation_goes_on(runtime, tmp_path, monkeypatch) -> None:
    cold = _cold(runtime, PROMPT)
    lines: list[str] = []
    cache = _cache(runtime, tmp_path, lines)
    cache.stored = 0

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr("specexec.kv.prefix_disk.os.replace", full)
    assert _run(runtime, PROMPT)[0] == cold and _run(runtime, PROMPT)[0] == cold
    assert len(lines) == 1 and "No space left on device" in lines[0] and "answers are unchanged" in lines[0]
    assert not list((tmp_path / "prefix").rglob("*.blk")) and cache.disk.writable is False
    _run(runtime, OTHER)
    assert _run(runtime, PROMPT) == (cold, 80)            # the RAM tier still serves


def test_the_disk_tier_stays_under_its_size_and_other_models_miss(runtime, tmp_path) -> None:
    lines: list[str] = []
    one = _cache(runtime, tmp_path, lines)
    _run(runtime, PROMPT)
    size = one.disk.nbytes // one.stored
    small = _cache(runtime, tmp_path / "small", lines, limit=3 * size + size // 2)
    _run(runtime, OTHER)
    _run(runtime, PROMPT)
    files = list((tmp_path / "small" / "prefix").glob("*.blk"))
    assert len(files) == 3 and sum(f.stat().st_size for f in files) == small.disk.nbytes <= small.disk.limit
    other = PrefixCache("another-model", 2**30, tmp_path / "prefix", BLOCK, lines.append)
    assert other.cached(PROMPT) == 0 and one.cached(PROMPT) == 80 and lines == []
