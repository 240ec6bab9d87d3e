"""Bad flag values and budgets through the real command line: ONE line `error: ...`, exit code 2, nothing cached,
and the line is exactly what specexec.options (or a config built from it) says for that value -- the one place user input is validated
(cli/ only parses strings and hands them over; see options.py's module docstring).

Decisions these tests pin down:
- --max-new-tokens 0 (or negative) is an error, like every other out-of-range count: no silent no-op;
- a budget beyond the machine (--ram-budget above its total RAM, --budget above MAX_BUDGET, sizes above 2**62)
  is an error naming the limit, never planned with (no out-of-memory halfway through loading);
- --gpu-budget without CUDA is meaningless: ignored with a warning (the run goes on), as DESIGN.md says;
- flag values are checked before anything is loaded: a bad value with a missing model reports the value.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import psutil
import pytest
import torch

from specexec.builders.registry import check_builder
from specexec.config import EngineConfig, OffloadConfig, SamplingParams
from specexec.options import (ConfigError, budget_options, check_budget_fits, check_device, parse_draft_layers,
                              parse_draft_vocab, parse_size)
from tests.reliability.checks import assert_nothing_cached, assert_one_line_error

pytestmark = pytest.mark.timeout(120)


def _config_error(make, flag: str | None = None) -> str:
    """The message specexec.options raises for a value (what the CLI must print after 'error: '): where it is
    about the setting `flag` sets, named as the flag (max_new_tokens -> --max-new-tokens)."""
    with pytest.raises(ConfigError) as info:
        make()
    error = info.value
    if flag and error.subject and error.subject.replace("_", "-") == flag.lstrip("-"):
        error = error.named(flag)
    return str(error)


# flag values -> the config call that judges the same value. Each runs against a model path that does not
# exist: the flag must be reported, so it was checked before any loading.
CASES = {
    "ram-budget lots": (["--ram-budget", "lots"], lambda: OffloadConfig.from_flags(ram_budget="lots")),
    "ram-budget 0": (["--ram-budget", "0"], lambda: OffloadConfig.from_flags(ram_budget="0")),
    "ram-budget -5GB": (["--ram-budget=-5GB"], lambda: OffloadConfig.from_flags(ram_budget="-5GB")),
    "ram-budget 1e30 bytes": (["--ram-budget", str(10**30)], lambda: OffloadConfig.from_flags(ram_budget=str(10**30))),
    "gpu-budget lots": (["--gpu-budget", "lots"], lambda: OffloadConfig.from_flags(gpu_budget="lots")),
    "gpu-budget nan": (["--gpu-budget", "nan"], lambda: OffloadConfig.from_flags(gpu_budget="nan")),
    "temperature -1": (["--temperature", "-1"], lambda: SamplingParams(temperature=-1.0)),
    "temperature nan": (["--temperature", "nan"], lambda: SamplingParams(temperature=math.nan)),
    "temperature inf": (["--temperature", "inf"], lambda: SamplingParams(temperature=math.inf)),
    "top-p 0": (["--top-p", "0"], lambda: SamplingParams(top_p=0.0)),
    "top-p 1.5": (["--top-p", "1.5"], lambda: SamplingParams(top_p=1.5)),
    "top-p nan": (["--top-p", "nan"], lambda: SamplingParams(top_p=math.nan)),
    "top-k -1": (["--top-k", "-1"], lambda: SamplingParams(top_k=-1)),
    "min-p 2": (["--min-p", "2"], lambda: SamplingParams(min_p=2.0)),
    "repetition-penalty 0": (["--repetition-penalty", "0"], lambda: SamplingParams(repetition_penalty=0.0)),
    "seed -1": (["--seed", "-1"], lambda: SamplingParams(seed=-1)),
    "budget 0": (["--budget", "0"], lambda: EngineConfig(budget=0)),
    "budget -5": (["--budget", "-5"], lambda: EngineConfig(budget=-5)),
    "budget 10**9": (["--budget", str(10**9)], lambda: EngineConfig(budget=10**9)),
    "budget many": (["--budget", "many"], lambda: budget_options("many")),
    "draft-layers many": (["--draft-layers", "many"], lambda: parse_draft_layers("many")),
    "draft-vocab many": (["--draft-vocab", "many"], lambda: parse_draft_vocab("many")),
    "max-budget 10**9": (["--budget", "auto", "--max-budget", str(10**9)],
                         lambda: budget_options("auto", 10**9)),
    "max-new-tokens 0": (["--max-new-tokens", "0"], lambda: EngineConfig(max_new_tokens=0)),
    "max-new-tokens -3": (["--max-new-tokens", "-3"], lambda: EngineConfig(max_new_tokens=-3)),
    "max-new-tokens 10**9": (["--max-new-tokens", str(10**9)], lambda: EngineConfig(max_new_tokens=10**9)),
    "device tpu": (["--device", "tpu"], lambda: EngineConfig(device="tpu")),
    "dtype int3": (["--dtype", "int3"], lambda: EngineConfig(dtype="int3")),
    "gate sometimes": (["--gate", "sometimes"], lambda: EngineConfig(gate="sometimes")),
    "builder magic": (["--builder", "magic"], lambda: check_builder("magic")),
    "quant nf5": (["--quant", "nf5"], lambda: OffloadConfig(quant="nf5")),
    "offload cloud": (["--offload", "cloud"], lambda: OffloadConfig(offload="cloud")),
    "cache-dir blank": (["--cache-dir", " "], lambda: OffloadConfig(cache_dir=" ")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_value_is_configs_one_line(case, cli, cache_root, tmp_path):
    flags, judge = CASES[case]
    expected = _config_error(judge, flags[0].split("=")[0])
    assert "_" not in expected.split()[0] + expected.split()[1]        # a flag's name, never a field's
    result = cli("generate", "--model", tmp_path / "no-such-model", "--no-draft", "--prompt", "Hello",
                 "--cache-dir", cache_root, *flags)
    line = assert_one_line_error(result)
    assert line == f"error: {expected}", "the CLI's message is not options.py's: a second validation place?"
    assert_nothing_cached(cache_root)


@pytest.mark.parametrize("case", ["temperature nan", "top-p 1.5", "budget 0", "ram-budget lots",
                                  "max-new-tokens 0", "gate sometimes"])
def test_chat_validates_the_same_way(case, cli, cache_root, tmp_path):
    """`chat` shares the flags and their checks (cli/args.py -> specexec.options): the same line."""
    flags, judge = CASES[case]
    result = cli("chat", "--model", tmp_path / "no-such-model", "--no-draft", "--cache-dir", cache_root, *flags)
    assert assert_one_line_error(result) == f"error: {_config_error(judge, flags[0].split('=')[0])}"
    assert_nothing_cached(cache_root)


def test_non_numeric_values_are_usage_errors(cli, tmp_path):
    for flags in (["--temperature", "hot"], ["--top-k", "1.5"], ["--max-new-tokens", "many"], ["--seed", "x"]):
        result = cli("generate", "--model", tmp_path / "m", "--no-draft", "--prompt", "x", *flags)
        assert_one_line_error(result, flags[0], "invalid")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(cli, cache_root, tiny_llama):
    result = cli("generate", "--model", tiny_llama, "--no-draft", "--prompt", "x", "--device", "cuda",
                 "--cache-dir", cache_root)
    line = assert_one_line_error(result)
    assert line == f"error: {_config_error(lambda: check_device('cuda'))}"
    assert_nothing_cached(cache_root)


def _generate(cli, model: Path, cache: Path, *flags: str):
    return cli("generate", "--model", model, "--no-draft", "--prompt", "Hello", "--max-new-tokens", "2",
               "--cache-dir", cache, *flags)


@pytest.mark.parametrize("offload", ["auto", "ssd", "ram"])
def test_ram_budget_below_one_layer(offload, cli, cache_root, tiny_llama):
    """1 kB cannot hold even the streaming slots (one tiny layer is ~100 kB): the planner says what is needed,
    every size in one unit with the digits that show it (not '0.00 GB'), before the cache is built."""
    result = _generate(cli, tiny_llama, cache_root, "--ram-budget", "1kB", "--offload", offload, "--quant", "none")
    line = assert_one_line_error(result, "--ram-budget 0.0000010 GB cannot hold", "raise --ram-budget to at least")
    assert "0.00 GB" not in line and set(re.findall(r"[\d.]+ ([a-zA-Z]*B)\b", line)) == {"GB"}
    assert_nothing_cached(cache_root)


def test_ram_budget_beyond_the_machine(cli, cache_root, tiny_llama):
    """Far above total RAM (but a valid size): refused with the machine's figure, not planned with."""
    total = psutil.virtual_memory().total
    result = _generate(cli, tiny_llama, cache_root, "--ram-budget", "1000000TB")
    line = assert_one_line_error(result)
    assert line == f"error: {_config_error(lambda: check_budget_fits('--ram-budget', 10**18, total, 'RAM'))}"
    assert_nothing_cached(cache_root)


def test_sizes_above_the_representable_are_refused():
    """The string parser and the dataclass agree on one limit: 2**62 bytes."""
    assert parse_size("1TB", "x") == 10**12 and parse_size("1TiB", "x") == 2**40
    with pytest.raises(ConfigError, match="--ram-budget must be in"):
        OffloadConfig.from_flags(ram_budget=f"{2**63}B")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_budget_without_cuda_is_ignored_with_a_warning(cli, cache_root, tiny_llama):
    result = _generate(cli, tiny_llama, cache_root, "--gpu-budget", "1kB")
    assert result.code == 0, result.err
    assert "--gpu-budget means nothing without CUDA" in result.err


@pytest.mark.gpu
def test_gpu_budgets_below_one_layer_and_beyond_the_gpu(cli, cache_root, tiny_llama):
    """On CUDA: 1 kB of GPU cannot hold the streaming slots; 1000000 TB is more than the GPU has."""
    small = _generate(cli, tiny_llama, cache_root, "--device", "cuda", "--gpu-budget", "1kB", "--quant", "none")
    assert_one_line_error(small, "--gpu-budget 0.0000010 GB cannot hold")
    huge = _generate(cli, tiny_llama, cache_root, "--device", "cuda", "--gpu-budget", "1000000TB")
    assert_one_line_error(huge, "--gpu-budget", "more than this machine's")
    assert_nothing_cached(cache_root)
