"""Numbers of a config.json that no real model has, through the real command line: ONE line naming the field,
exit 2, before anything is allocated (a layer count of 1e9 had `generate` build modules until memory ran out and
`plan` hang; a norm epsilon of 0 gave rc 0 and empty text). A config naming more layers than the checkpoint's
tensors hold is refused before a model of that size is built."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from specexec.checkpoints.loading import read_args
from specexec.options import ConfigError
from tests.reliability.checks import assert_nothing_cached, assert_one_line_error, copy_checkpoint

pytestmark = pytest.mark.timeout(120)

CASES = {
    "layers 1e9": ("num_hidden_layers", 1e9, "num_hidden_layers"),
    "layers 4.5": ("num_hidden_layers", 4.5, "whole number"),
    "layers '4'": ("num_hidden_layers", "4", "whole number"),
    "layers true": ("num_hidden_layers", True, "whole number"),
    "head_dim 0": ("head_dim", 0, "head_dim"),
    "context 1e12": ("max_position_embeddings", 10**12, "max_position_embeddings"),
    "vocab -1": ("vocab_size", -1, "vocab_size"),
    "eps 0": ("rms_norm_eps", 0, "rms_norm_eps"),
    "eps -1e-6": ("rms_norm_eps", -1e-6, "rms_norm_eps"),
    "eps 'tiny'": ("rms_norm_eps", "tiny", "finite number"),
    "eps NaN": ("rms_norm_eps", math.nan, "finite number"),
    "rope_theta 0": ("rope_theta", 0, "rope_theta"),
    "rope_theta inf": ("rope_theta", math.inf, "finite number"),
    "eos 'x'": ("eos_token_id", "x", "token id"),
    "kv heads 3 of 4": ("num_key_value_heads", 3, "KV heads"),
    "architectures text": ("architectures", "LlamaForCausalLM", "list of names"),
}


def _broken(src: Path, dest: Path, key: str, value) -> Path:
    path = copy_checkpoint(src, dest)
    cfg = json.loads((path / "config.json").read_text())
    cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))           # NaN / Infinity as Python's json writes them
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_a_number_no_model_has_is_one_line_naming_the_field(case, tiny_llama, tmp_path) -> None:
    key, value, needle = CASES[case]
    path = _broken(tiny_llama, tmp_path / "m", key, value)
    with pytest.raises(ConfigError) as info:
        read_args(path)
    assert needle.lower() in str(info.value).lower() and "\n" not in str(info.value)


@pytest.mark.parametrize("command", ["generate", "plan"])
def test_a_billion_layers_is_refused_at_once(command, cli, cache_root, tiny_llama, tmp_path) -> None:
    path = _broken(tiny_llama, tmp_path / "m", "num_hidden_layers", 1e9)
    argv = ["--model", path] + (["--no-draft", "--prompt", "x", "--cache-dir", cache_root] if command == "generate"
                                else [])
    t0 = time.monotonic()
    line = assert_one_line_error(cli(command, *argv), "num_hidden_layers", "1000000000")
    assert time.monotonic() - t0 < 30, line
    assert_nothing_cached(cache_root)


def test_more_layers_than_the_tensors_hold(cli, cache_root, tiny_llama, tmp_path) -> None:
    path = _broken(tiny_llama, tmp_path / "m", "num_hidden_layers", 4000)
    line = assert_one_line_error(cli("generate", "--model", path, "--no-draft", "--prompt", "x", "--cache-dir",
                                     cache_root), "config.json says 4000 decoder layers", "hold 2")
    assert line
    assert_nothing_cached(cache_root)


@pytest.mark.parametrize("mode", [[], ["--quant", "none", "--offload", "ssd"]], ids=["resident", "streamed"])
def test_nan_weights_stop_at_the_first_pass_naming_the_layer(mode, cli, cache_root, tiny_llama, tmp_path) -> None:
    """NaN in layer 1's weights: rc 2 and one line naming layer 1 (it had been rc 0, one token, empty text)."""
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(tiny_llama, tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = math.nan
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    result = cli("generate", "--model", path, "--no-draft", "--prompt", "Hello", "--max-new-tokens", "4",
                 "--cache-dir", cache_root, *mode)
    assert result.code == 2 and "Traceback" not in result.err and result.out == "", result.err
    last = result.err.rstrip("\n").splitlines()[-1]                  # after the load lines: one error line
    assert last.startswith("error: the target's first pass gives non-finite values (NaN or Inf) in the output of "
                           "decoder layer 1 (of 2)"), last


def test_where_names_the_first_place() -> None:
    from specexec.finite import where

    assert where([0, 0, 0, 0, 0], 3) is None
    assert where([3, 3, 3, 3, 3], 3) == "in the token embeddings"
    assert where([0, 0, 5, 5, 5], 3) == "in the output of decoder layer 1 (of 3)"
    assert where([0, 0, 0, 0, 1], 3) == "in the final norm"
