"""The one cache root and the per-fingerprint JSON store (specexec/tuning/store.py): --budget auto's costs, a
pair's acceptance vectors, VocabTrim's counts and the demo models all live under the root every cache uses
($SPECEXEC_CACHE, else $XDG_CACHE_HOME/specexec, else ~/.cache/specexec); a damaged file is measured again."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cli.demo import cache_dir as demo_dir
from cpu_kernels.cache_root import default_cache_root
from specexec.tuning import acceptance, store
from specexec.tuning.calibration import default_cost_path
from specexec.tuning.vocab_trim import cache_path, load_or_measure_counts


def _every_place() -> list[Path]:
    return [default_cost_path("f"), acceptance.default_path("f"), cache_path("key"), demo_dir()]


@pytest.mark.parametrize("env", ["SPECEXEC_CACHE", "XDG_CACHE_HOME", "HOME"])
def test_every_tuning_cache_and_the_demo_follow_the_one_root(env: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SPECEXEC_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env, str(tmp_path))
    root = default_cache_root()
    assert root == {"SPECEXEC_CACHE": tmp_path, "XDG_CACHE_HOME": tmp_path / "specexec",
                    "HOME": tmp_path / ".cache" / "specexec"}[env]
    places = _every_place()
    assert [p.relative_to(root).parts[0] for p in places] == ["costs", "acceptance", "vocab", "demo"]


def test_a_damaged_or_foreign_count_cache_is_measured_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path))
    measured: list[int] = []

    def measure() -> torch.Tensor:
        measured.append(1)
        return torch.tensor([0.0, 3.0, 1.0], dtype=torch.float64)

    path = cache_path("k")
    path.parent.mkdir(parents=True)
    for damage in ("{not json", '["a list"]', '{"key": "k", "vocab_size": 3, "counts": {"x": 1}}'):
        path.write_text(damage)
        assert load_or_measure_counts("k", 3, measure).tolist() == [0.0, 3.0, 1.0]
    assert len(measured) == 3
    assert load_or_measure_counts("k", 3, measure).tolist() == [0.0, 3.0, 1.0] and len(measured) == 3   # cached


def test_write_is_whole_or_nothing_and_leaves_no_temporary_file(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kind" / "fp.json"
    store.write_json(path, {"a": 1})
    assert store.read_json(path) == {"a": 1}

    def broken(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(store.os, "replace", broken)
    with pytest.raises(OSError):
        store.write_json(path, {"a": 2})
    assert store.read_json(path) == {"a": 1} and [p.name for p in path.parent.iterdir()] == ["fp.json"]
