"""Checkpoint files written to mislead, through the real command line: an index or a symlink that places a
weight file outside the checkpoint directory is refused unless --allow-outside-shards says the user means it (a
Hugging Face cache snapshot's links into its blobs/ are inside); an index whose weight_map is not a mapping, a
config.json nested 100k deep, a chat template the sandbox refuses: each ONE line, exit 2, never 'internal error'."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.reliability.checks import assert_one_line_error, copy_checkpoint

pytestmark = pytest.mark.timeout(120)


def _generate(cli, model: Path, cache: Path, *flags: str):
    return cli("generate", "--model", model, "--no-draft", "--prompt", "Hello", "--max-new-tokens", "2",
               "--cache-dir", cache, *flags)


def _index_pointing_outside(tiny_llama: Path, tmp_path: Path) -> Path:
    model = copy_checkpoint(tiny_llama, tmp_path / "model")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.replace(model / "model.safetensors", outside / "weights.safetensors")
    from safetensors import safe_open

    with safe_open(str(outside / "weights.safetensors"), "pt") as f:
        names = list(f.keys())
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "../elsewhere/weights.safetensors" for n in names}}))
    return model


def test_an_index_naming_a_file_outside_is_refused_unless_allowed(cli, cache_root, tiny_llama, tmp_path,
                                                                   monkeypatch) -> None:
    monkeypatch.setenv("SPECEXEC_ALLOW_OUTSIDE_SHARDS", "0")        # restored after the flag sets it
    model = _index_pointing_outside(tiny_llama, tmp_path)
    assert_one_line_error(_generate(cli, model, cache_root), "lies outside", "--allow-outside-shards")
    assert _generate(cli, model, cache_root, "--allow-outside-shards").code == 0


def test_a_symlink_leading_outside_is_refused(cli, cache_root, tiny_llama, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("SPECEXEC_ALLOW_OUTSIDE_SHARDS", raising=False)
    model = copy_checkpoint(tiny_llama, tmp_path / "model")
    os.replace(model / "model.safetensors", tmp_path / "secret.safetensors")
    (model / "model.safetensors").symlink_to(tmp_path / "secret.safetensors")
    assert_one_line_error(_generate(cli, model, cache_root), "lies outside")


def test_a_hub_cache_snapshot_linking_into_its_blobs_is_inside(cli, cache_root, tiny_llama, tmp_path,
                                                                 monkeypatch) -> None:
    monkeypatch.delenv("SPECEXEC_ALLOW_OUTSIDE_SHARDS", raising=False)
    repo = tmp_path / "models--org--tiny"
    snapshot = copy_checkpoint(tiny_llama, repo / "snapshots" / "abc123")
    (repo / "blobs").mkdir()
    os.replace(snapshot / "model.safetensors", repo / "blobs" / "f00d")
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs/f00d"))
    assert _generate(cli, snapshot, cache_root).code == 0


@pytest.mark.parametrize("weight_map", [["model.safetensors"], {"x": 3}, "model.safetensors"])
def test_an_index_whose_weight_map_is_not_a_mapping(cli, cache_root, tiny_llama, tmp_path, weight_map) -> None:
    model = copy_checkpoint(tiny_llama, tmp_path / "model")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_one_line_error(_generate(cli, model, cache_root), "not a valid safetensors index")


def test_a_config_nested_100k_deep(cli, cache_root, tiny_llama, tmp_path) -> None:
    model = copy_checkpoint(tiny_llama, tmp_path / "model")
    (model / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert_one_line_error(_generate(cli, model, cache_root), "config.json", "nests")


def test_a_chat_template_the_sandbox_refuses(cli, cache_root, tiny_llama, tmp_path) -> None:
    model = copy_checkpoint(tiny_llama, tmp_path / "model")
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    for name in ("chat_template.jinja",):
        (model / name).write_text(template)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert_one_line_error(_generate(cli, model, cache_root, "--chat"), "chat template failed")
