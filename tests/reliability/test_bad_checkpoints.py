"""Broken checkpoints through the real command line: every one ends in ONE line `error: ...` on stderr with exit
code 2, no traceback, and NOTHING written to the layer-cache root (not even a lock file), on every path that
reads weights: `generate` (resident), `generate --quant none --offload ssd` and `generate --quant nf4 --offload
ram --ram-budget 256MB` (the offloaded target, which builds the layer cache) and `convert` (which only builds
the layer cache).

Decisions these tests pin down:
- extra tensors the config does not explain are refused (like a missing or misshapen one), on every path:
  a checkpoint whose tensor set differs from its config.json is not the model the config describes;
- integer/bool weights are refused; float16/bfloat16 weights are fine (cast to the run dtype);
- pickle weights are refused unless --allow-pickle, and nothing is ever unpickled before that decision;
- a tokenizer is needed to generate, not to convert.
"""
from __future__ import annotations

import builtins
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.reliability.checks import assert_nothing_cached, assert_one_line_error, checkpoint_argv, copy_checkpoint

pytestmark = pytest.mark.timeout(120)

LAYER = "model.layers.1.mlp.up_proj.weight"


# ------------------------------------------------------------------------------------------ ways to break one

def _rewrite(path: Path, change: Callable[[dict], None]) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _edit_config(path: Path, change: Callable[[dict], None]) -> None:
    cfg = json.loads((path / "config.json").read_text())
    change(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def missing_config(p: Path) -> Path:
    (p / "config.json").unlink()
    return p


def missing_tokenizer(p: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (p / name).unlink(missing_ok=True)
    return p


def gpt2_architecture(p: Path) -> Path:
    _edit_config(p, lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    return p


def bert_model_type(p: Path) -> Path:
    _edit_config(p, lambda c: (c.pop("architectures"), c.update(model_type="bert")))
    return p


def truncated_tail(p: Path) -> Path:
    f = p / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    return p


def garbage_header(p: Path) -> Path:
    f = p / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"\x00\xff garbage, certainly not JSON \x01"
    f.write_bytes(bytes(data))
    return p


def huge_header_length(p: Path) -> Path:
    """The first 8 bytes (the header length) claim an exabyte: a naive reader would try to allocate it."""
    f = p / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes((2**60).to_bytes(8, "little") + data[8:])
    return p


def integer_weight(p: Path) -> Path:
    _rewrite(p, lambda t: t.update({LAYER: torch.ones(128, 64, dtype=torch.int32)}))
    return p


def wrong_layer_shape(p: Path) -> Path:
    _rewrite(p, lambda t: t.update({LAYER: torch.zeros(128, 63)}))
    return p


def wrong_resident_shape(p: Path) -> Path:
    _rewrite(p, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    return p


def config_disagrees(p: Path) -> Path:
    """The weights are fine; config.json claims a wider MLP (every MLP weight then has the wrong shape)."""
    _edit_config(p, lambda c: c.update(intermediate_size=256))
    return p


def missing_layer_tensor(p: Path) -> Path:
    _rewrite(p, lambda t: t.pop(LAYER))
    return p


def missing_head(p: Path) -> Path:
    _rewrite(p, lambda t: t.pop("lm_head.weight"))
    return p


def extra_tensor(p: Path) -> Path:
    _rewrite(p, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(4, 4)}))
    return p


def extra_layer(p: Path) -> Path:
    """Weights for a third decoder layer that config.json (2 layers) does not have."""
    _rewrite(p, lambda t: t.update({"model.layers.2.input_layernorm.weight": torch.ones(64)}))
    return p


def index_missing_shard(p: Path) -> Path:
    names = list(load_file(p / "model.safetensors"))
    (p / "model.safetensors").rename(p / "model-00001-of-00002.safetensors")
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (p / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return p


def index_garbage(p: Path) -> Path:
    (p / "model.safetensors.index.json").write_text("{ not json")
    return p


def weights_symlink_loop(p: Path) -> Path:
    (p / "model.safetensors").unlink()
    os.symlink("model.safetensors", p / "model.safetensors")          # a link to itself: ELOOP on open
    return p


def config_symlink_loop(p: Path) -> Path:
    (p / "config.json").unlink()
    os.symlink("config.json", p / "config.json")
    return p


def directory_symlink_loop(p: Path) -> Path:
    loop = p.parent / "loop"
    os.symlink(loop.name, loop)                                        # --model points at a link to itself
    return loop


# name -> (break it, words the one line must contain, paths it applies to)
ALL = ("generate", "offload", "ram-budget", "convert")
CASES: dict[str, tuple[Callable[[Path], Path], tuple[str, ...], tuple[str, ...]]] = {
    "missing config.json": (missing_config, ("no config.json",), ALL),
    "missing tokenizer": (missing_tokenizer, ("no tokenizer",), ("generate", "offload", "ram-budget")),
    "GPT2 architecture": (gpt2_architecture, ("unsupported architecture", "GPT2LMHeadModel"), ALL),
    "bert model_type": (bert_model_type, ("unsupported architecture", "bert"), ALL),
    "truncated tail": (truncated_tail, ("model.safetensors",), ALL),
    "garbage header": (garbage_header, ("model.safetensors",), ALL),
    "huge header length": (huge_header_length, ("model.safetensors",), ALL),
    "integer weight": (integer_weight, (LAYER, "int32"), ALL),
    "wrong layer shape": (wrong_layer_shape, (LAYER, "[128, 63]", "[128, 64]"), ALL),
    "wrong resident shape": (wrong_resident_shape, ("model.norm.weight", "[63]", "[64]"), ALL),
    "config disagrees with weights": (config_disagrees, ("shape", "config.json"), ALL),
    "missing layer tensor": (missing_layer_tensor, ("missing", LAYER.removeprefix("model.")), ALL),
    "missing lm_head": (missing_head, ("missing", "lm_head.weight"), ALL),
    "extra tensor": (extra_tensor, ("unexpected tensor", "model.layers.0.mlp.extra.weight"), ALL),
    "extra layer": (extra_layer, ("unexpected tensor", "model.layers.2.input_layernorm.weight"), ALL),
    "index names a missing shard": (index_missing_shard, ("model-00002-of-00002.safetensors", "missing"), ALL),
    "index is not JSON": (index_garbage, ("model.safetensors.index.json",), ALL),
    "weights symlink loop": (weights_symlink_loop, ("model.safetensors", "symlink", "loop"), ALL),
    "config symlink loop": (config_symlink_loop, ("config.json", "symlink", "loop"), ALL),
    "model dir symlink loop": (directory_symlink_loop, ("loop", "symlink that leads nowhere"), ALL),
}


@pytest.mark.parametrize("mode", ALL)
@pytest.mark.parametrize("case", list(CASES))
def test_broken_checkpoint_is_one_line_and_caches_nothing(case, mode, cli, cache_root, tiny_llama, tmp_path):
    breaker, needles, modes = CASES[case]
    if mode not in modes:
        pytest.skip(f"{case} is not an error for {mode}")
    model = breaker(copy_checkpoint(tiny_llama, tmp_path / "ckpt"))
    result = cli(*checkpoint_argv(mode, model, cache_root))
    assert_one_line_error(result, *needles)
    assert_nothing_cached(cache_root, tmp_path / "xdg-cache")


def test_broken_draft_caches_nothing_for_the_target(cli, cache_root, tiny_pair, tmp_path):
    """The draft loads (and is checked) before the offloaded target's layer cache is built."""
    target, draft = tiny_pair
    broken = extra_tensor(copy_checkpoint(draft, tmp_path / "draft"))
    result = cli("generate", "--model", target, "--draft", broken, "--prompt", "Hello", "--max-new-tokens", "2",
                 "--quant", "nf4", "--offload", "ssd", "--cache-dir", cache_root)
    assert_one_line_error(result, "unexpected tensor", str(broken))
    assert_nothing_cached(cache_root)


def test_the_cache_flags_do_write_there(cli, cache_root, tiny_llama):
    """The control: the same command lines on an intact checkpoint succeed and DO write under the root, so the
    'nothing cached' checks above are not vacuous."""
    assert cli(*checkpoint_argv("offload", tiny_llama, cache_root)).code == 0
    assert any(cache_root.glob("*/manifest.json"))
    other = cache_root.parent / "converted"
    result = cli(*checkpoint_argv("convert", tiny_llama, other))
    assert result.code == 0, result.err
    assert any(other.glob("*/manifest.json"))


def test_tokenizer_is_not_needed_to_convert(cli, cache_root, tiny_llama, tmp_path):
    model = missing_tokenizer(copy_checkpoint(tiny_llama, tmp_path / "ckpt"))
    result = cli(*checkpoint_argv("convert", model, cache_root))
    assert result.code == 0, result.err


def test_half_precision_weights_are_cast_not_refused(cli, cache_root, tiny_llama, tmp_path):
    model = copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    _rewrite(model, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    for mode in ("generate", "offload"):
        result = cli(*checkpoint_argv(mode, model, cache_root))
        assert result.code == 0, result.err


# ------------------------------------------------------------------------------------------ pickle

class _Evil:
    """Unpickling this creates `marker` (through builtins.open): proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def _evil_checkpoint(tiny: Path, dest: Path, marker: Path, keep_safetensors: bool = False) -> Path:
    copy_checkpoint(tiny, dest)
    if not keep_safetensors:
        (dest / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": _Evil(marker)}, dest / "pytorch_model.bin")
    return dest


@pytest.mark.parametrize("mode", ALL)
def test_pickle_is_refused_and_never_unpickled(mode, cli, cache_root, tiny_llama, tmp_path):
    marker = tmp_path / "PWNED"
    model = _evil_checkpoint(tiny_llama, tmp_path / "ckpt", marker)
    assert_one_line_error(cli(*checkpoint_argv(mode, model, cache_root)), "pickle")
    assert not marker.exists(), "the pickle was unpickled"
    assert_nothing_cached(cache_root)


def test_allow_pickle_still_runs_no_code(cli, cache_root, tiny_llama, tmp_path):
    """--allow-pickle reads with torch.load(weights_only=True): the payload is refused, not run."""
    marker = tmp_path / "PWNED"
    model = _evil_checkpoint(tiny_llama, tmp_path / "ckpt", marker)
    assert_one_line_error(cli(*checkpoint_argv("generate", model, cache_root), "--allow-pickle"), "plain tensors")
    assert not marker.exists()
    assert_nothing_cached(cache_root)


@pytest.mark.parametrize("mode", ALL)
def test_pickle_beside_safetensors_is_ignored_unopened(mode, cli, cache_root, tiny_llama, tmp_path):
    """A stray pytorch_model.bin next to model.safetensors: the safetensors are used, the pickle never opened."""
    marker = tmp_path / "PWNED"
    model = _evil_checkpoint(tiny_llama, tmp_path / "ckpt", marker, keep_safetensors=True)
    result = cli(*checkpoint_argv(mode, model, cache_root))
    assert result.code == 0, result.err
    assert not marker.exists()
