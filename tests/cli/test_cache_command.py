"""`specexec cache ls | du | rm MODEL`: the layer caches under the cache root listed with their model, size and
checkpoint; every entry of the root sized; a model's caches removed (and nothing else), a name that matches none
said in one line with the names there are."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main


def _layer_cache(root: Path, name: str, checkpoint: str, nbytes: int) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "layers.bin").write_bytes(b"\0" * nbytes)
    (d / "manifest.json").write_text(json.dumps({"checkpoint": checkpoint, "format": "int4", "dtype": "float32",
                                                 "layers": [{}, {}], "created": "2026-12-08T01:00:00+0000"}))
    return d


@pytest.fixture
def root(tmp_path: Path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECEXEC_CACHE", str(root))
    _layer_cache(root, "qwen3-8b-int4-float32-0123456789abcdef", "/models/qwen3-8b", 3000)
    _layer_cache(root, "llama-3.1-8b-instruct-nf4-bfloat16-fedcba9876543210", "/m/llama-3.1-8b-instruct", 2000)
    (root / "kernels").mkdir()
    (root / "kernels" / "lib.so").write_bytes(b"\0" * 500)
    return root


def test_ls_and_du_show_what_is_kept(root: Path, capsys) -> None:
    assert main(["cache", "ls", "--json"]) == 0
    caches = json.loads(capsys.readouterr().out)["layer_caches"]
    assert [(c["name"].split("-int4")[0].split("-nf4")[0], c["checkpoint"], c["layers"]) for c in caches] == [
        ("llama-3.1-8b-instruct", "/m/llama-3.1-8b-instruct", 2), ("qwen3-8b", "/models/qwen3-8b", 2)]
    assert main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert "2 layer caches" in out and "from /models/qwen3-8b" in out
    assert main(["cache", "du", "--json"]) == 0
    du = json.loads(capsys.readouterr().out)
    assert du["entries"]["kernels"] == 500 and du["bytes"] >= 5500


def test_rm_removes_one_model_s_caches_under_their_lock(root: Path, capsys) -> None:
    assert main(["cache", "rm", "qwen3-8b"]) == 0
    out = capsys.readouterr().out
    assert "removed" in out and "freed" in out
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "kernels", "llama-3.1-8b-instruct-nf4-bfloat16-fedcba9876543210"]
    assert not list(root.glob("*.lock"))                     # no lock file beside the caches
    assert main(["cache", "rm", "qwen3-8b"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no layer cache of 'qwen3-8b' under ") and "llama-3.1-8b-instruct-nf4" in err
    assert main(["cache", "rm", "llama-3.1-8b-instruct"]) == 0          # the checkpoint's directory name
    assert main(["cache", "ls"]) == 0 and "no layer caches" in capsys.readouterr().out
    assert main(["cache", "rm"]) == 2 and "needs the MODEL" in capsys.readouterr().err
