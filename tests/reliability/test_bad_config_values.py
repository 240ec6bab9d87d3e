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


LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ROPE_CASES = {       # inside rope_parameters: a factor of -2 or an original context of 1e30 had run, rc 0, garbage
    "factor -2": ({**LLAMA3, "factor": -2.0}, "rope_parameters: factor -2.0"),
    "factor 0": ({**LLAMA3, "factor": 0}, "rope_parameters: factor 0"),
    "factor NaN": ({**LLAMA3, "factor": math.nan}, "factor must be a finite number"),
    "low_freq_factor 'x'": ({**LLAMA3, "low_freq_factor": "x"}, "low_freq_factor must be a finite number"),
    "original context 1e30": ({**LLAMA3, "original_max_position_embeddings": 1e30},
                              "original_max_position_embeddings"),
    "rope_theta 'tiny'": ({**LLAMA3, "rope_theta": "tiny"}, "rope_theta must be a finite number"),
    "not an object": ("x", "rope_parameters must be an object"),
    "per layer kind": ({"full_attention": {**LLAMA3, "factor": -1.0}}, "rope_parameters full_attention: factor"),
    "longrope list": ({"rope_type": "longrope", "short_factor": [1.0, -1.0]}, "short_factor must be a list"),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_a_rope_setting_no_model_has_is_one_line_naming_it(case, tiny_llama, tmp_path) -> None:
    rope, needle = ROPE_CASES[case]
    path = _broken(tiny_llama, tmp_path / "m", "rope_parameters", rope)
    with pytest.raises(ConfigError) as info:
        read_args(path)
    assert needle.lower() in str(info.value).lower() and "\n" not in str(info.value), str(info.value)


def test_real_rope_settings_pass(tiny_llama, tmp_path) -> None:
    """The bounds leave every real setting alone: Llama 3.1's, YaRN's, DeepSeek's mscale 0, one per layer kind."""
    from specexec.families.config_values import check_rope

    for rope in (LLAMA3, {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                          "mscale": 0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
                 {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, None):
        check_rope(rope, "config.json rope_parameters")
    assert read_args(_broken(tiny_llama, tmp_path / "m", "rope_parameters", LLAMA3)).n_layers == 2


def test_a_negative_rope_factor_is_refused_by_generate(cli, cache_root, tiny_llama, tmp_path) -> None:
    path = _broken(tiny_llama, tmp_path / "m", "rope_parameters", {**LLAMA3, "factor": -2.0})
    assert_one_line_error(cli("generate", "--model", path, "--no-draft", "--prompt", "x", "--cache-dir", cache_root),
                          "rope_parameters: factor -2.0")
    assert_nothing_cached(cache_root)


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
    from specexec.decoding.finite import where

    assert where([0, 0, 0, 0, 0], 3) is None
    assert where([3, 3, 3, 3, 3], 3) == "in the token embeddings"
    assert where([0, 0, 5, 5, 5], 3) == "in the output of decoder layer 1 (of 3)"
    assert where([0, 0, 0, 0, 1], 3) == "in the final norm"
