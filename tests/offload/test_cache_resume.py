"""A layer cache build that stops part-way resumes where it stopped (offload/cache/journal.py): the next build
converts only the layers the journal does not vouch for, and the result is the cache an undisturbed build writes.
Counted, not timed: how many layers the second build quantizes. And `convert`'s --quality, --threads and its bar."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from offload.cache import journal
from offload.cache import store as C
from offload.cache.store import LOCKS, LayerCache
from specexec.checkpoints.loading import read_args
from specexec.checkpoints.naming import layer_names

pytestmark = pytest.mark.usefixtures("posix_facilities")


@pytest.fixture()
def model(tiny_pair: tuple[Path, Path], tmp_path: Path) -> Path:
    """A private copy of the tiny pair's 4-layer target."""
    return Path(shutil.copytree(tiny_pair[0], tmp_path / "target"))


def build(model: Path, root: Path, fmt: str = "int4", **kw) -> LayerCache:
    return LayerCache.open_or_build(model, layer_names(model, read_args(model)), fmt, torch.float32,
                                    cache_root=root, progress=False, **kw)


def digests(cache: LayerCache) -> list[str]:
    return [e["sha256"] for e in cache.manifest["layers"]]


def stop_at(monkeypatch: pytest.MonkeyPatch, layer: int, exc: BaseException) -> None:
    """The build stops (exc) when it is about to write layer `layer` (0-based)."""
    real, seen = C._write_layer, []

    def write(fd, buf, offset):
        if len(seen) == layer:
            raise exc
        seen.append(offset)
        real(fd, buf, offset)

    monkeypatch.setattr(C, "_write_layer", write)


def count_quantized(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    real, calls = C._quantize_layer, []
    monkeypatch.setattr(C, "_quantize_layer", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(143)])
def test_an_interrupted_build_resumes_with_the_layers_it_lacks(model: Path, tmp_path: Path, exc: BaseException,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    reference = build(model, tmp_path / "ref")
    n = reference.n_layers
    assert n == 4
    with monkeypatch.context() as m:
        stop_at(m, 2, exc)
        with pytest.raises(type(exc)):
            build(model, tmp_path / "c")
    temps = [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".") and p.name != LOCKS]
    assert len(temps) == 1 and len(journal.read_entries(temps[0], {})) == 0          # keyed: another build reads none
    calls, log = count_quantized(monkeypatch), []
    again = build(model, tmp_path / "c", log=log.append)
    assert again.built and len(calls) == n - 2, (len(calls), n)
    assert log == [f"resuming an interrupted build: 2 of {n} layers already converted"]
    assert digests(again) == digests(reference)
    assert (again.file.stat().st_size == reference.file.stat().st_size
            and not (again.path / journal.JOURNAL).exists())
    assert [p.name for p in (tmp_path / "c").iterdir() if p.name.startswith(".") and p.name != LOCKS] == []


def test_a_layer_whose_bytes_changed_is_converted_again(model: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal vouches for two layers, but the second's bytes were damaged (a power cut after the journal's
    line): that layer and the rest are converted again, the first is kept."""
    reference = build(model, tmp_path / "ref")
    with monkeypatch.context() as m:
        stop_at(m, 2, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            build(model, tmp_path / "c")
    (tmp,) = [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".") and p.name != LOCKS]
    second = json.loads((tmp / journal.JOURNAL).read_text().splitlines()[2])
    with open(tmp / "layers.bin", "r+b") as f:
        f.seek(second["offset"] + 100)
        byte = f.read(1)
        f.seek(second["offset"] + 100)
        f.write(bytes([byte[0] ^ 1]))
    calls = count_quantized(monkeypatch)
    again = build(model, tmp_path / "c", log=lambda _m: None)
    assert len(calls) == reference.n_layers - 1
    assert digests(again) == digests(reference)


def test_a_build_of_other_options_does_not_adopt_the_leftover(model: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """An int8 build beside an interrupted int4 one of the same checkpoint has its own directory; and an int4 build
    asked for the quality search does not take layers the default search wrote."""
    with monkeypatch.context() as m:
        stop_at(m, 2, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            build(model, tmp_path / "c")
    calls = count_quantized(monkeypatch)
    quality = build(model, tmp_path / "c", search="quality")
    assert len(calls) == quality.n_layers and quality.manifest["search"] == "quality"
    assert build(model, tmp_path / "c").path == quality.path and not build(model, tmp_path / "c").built
    assert build(model, tmp_path / "c", search="default").built                 # asked for by name: rebuilt


def test_convert_quality_threads_and_the_bar(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`convert --quality --threads 2`: the quality search, recorded in the manifest; the bar counts MB/s and
    an ETA; a bad --threads is one line."""
    from cli.main import main

    root, threads = tmp_path / "cache", torch.get_num_threads()
    try:
        assert main(["convert", "--model", str(model), "--quant", "int4", "--out", str(root), "--quality",
                     "--threads", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    assert "(built): 4 layers, int4" in out and "B/s" in err and "ETA" in err and "4/4 layers" in err
    (cache,) = [p for p in root.iterdir() if p.is_dir() and p.name != LOCKS]
    assert json.loads((cache / "manifest.json").read_text())["search"] == "quality"
    assert main(["convert", "--model", str(model), "--quant", "int4", "--out", str(root), "--threads", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --threads must be") and err.count("\n") == 1, err
