"""A plan on a CPU prices its compute from this CPU's kernels as `specexec bench kernels` measured them (the
pass: the longer of streaming and compute), or says it cannot; a plan that holds more RAM than this machine has
says so. The measured rates live under the cache root, keyed by the kernels, the threads and the format."""
from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
import torch

from cli.bench.components.kernels import RUNTIME_KERNELS, keep_rates
from cli.main import main
from specexec.tuning.cpu_rates import load_rates, rate_at, rate_fingerprint, save_rates

ROOT = Path(__file__).resolve().parents[2]
LLAMA_70B = str(ROOT / "specexec/checkpoints/configs/llama-3.1-70b-instruct")


@pytest.fixture(autouse=True)
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path))
    return tmp_path


def _plan(capsys, *flags: str) -> dict:
    assert main(["plan", "--model", LLAMA_70B, "--device", "cpu", "--quant", "int4", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_unmeasured_kernels_are_said_not_assumed_hidden(capsys) -> None:
    out = _plan(capsys, "--ram-budget", "24GB")
    assert out["compute"]["seconds"] is None and out["compute"]["pass_seconds"] is None
    assert main(["plan", "--model", LLAMA_70B, "--device", "cpu", "--quant", "int4", "--ram-budget", "24GB"]) == 0
    text = capsys.readouterr().out
    assert "compute not predicted: this CPU's int4 kernels were never measured here" in text
    assert "specexec bench kernels" in text and "assumed hidden" not in text


def test_measured_kernels_price_the_pass(capsys) -> None:
    """Every layer resident (nothing streams): the pass is its compute, the weight bytes it reads (the decoder
    layers and the head) at the rate measured for its rows."""
    rate = 20e9
    save_rates("int4", torch.get_num_threads(), {1: rate, 16: rate / 2})
    out = _plan(capsys, "--ram-budget", "512GB", "--offload", "none")
    compute = out["compute"]
    assert compute["rows"] == 1 and compute["bytes_per_s"] == rate
    assert compute["weight_bytes"] == out["ledger"]["resident target layers"] + out["ledger"]["target norm/head"]
    assert compute["seconds"] == pytest.approx(compute["weight_bytes"] / rate, rel=1e-3)
    assert compute["pass_seconds"] == pytest.approx(compute["seconds"], rel=1e-3)
    assert out["predicted_seconds_per_pass"] == 0.0                        # the streaming: nothing streams
    tree = _plan(capsys, "--ram-budget", "512GB", "--offload", "none", "--draft", "self", "--budget", "15")
    assert tree["compute"]["rows"] == 16 and tree["compute"]["bytes_per_s"] == rate / 2
    streamed = _plan(capsys, "--ram-budget", "24GB", "--offload", "ssd")
    assert streamed["compute"]["pass_seconds"] == pytest.approx(
        max(streamed["compute"]["seconds"], streamed["predicted_seconds_per_pass"]), rel=1e-3)


def test_a_plan_beyond_this_machines_ram_is_flagged(capsys) -> None:
    total = psutil.virtual_memory().total
    out = _plan(capsys, "--ram-budget", f"{2 * total // 10**9 + 64}GB", "--offload", "none")
    assert any("of RAM and this machine has" in w for w in out["warnings"])
    fits = _plan(capsys, "--ram-budget", f"{min(total // 2 // 10**9, 24)}GB")
    assert not any("this machine has" in w for w in fits["warnings"])


def test_rates_are_kept_per_kernels_threads_and_format() -> None:
    save_rates("int4", 2, {1: 10.0, 4: 30.0})
    assert load_rates("int4", 2) == {1: 10.0, 4: 30.0}
    assert load_rates("int4", 3) is None and load_rates("int8", 2) is None
    assert rate_fingerprint("int4", 2) != rate_fingerprint("int4", 3) != rate_fingerprint("int8", 3)
    rates = {1: 10.0, 4: 40.0}
    assert rate_at(rates, 1) == 10.0 and rate_at(rates, 64) == 40.0
    assert rate_at(rates, 2) == pytest.approx(1 / (0.1 + (0.025 - 0.1) / 3))     # seconds per byte, linear


def test_bench_kernels_keeps_the_runtimes_kernels_rates() -> None:
    rows = [{"kernel": RUNTIME_KERNELS["int4"], "rows": 1, "us": 100.0, "weight_bytes": 1000},
            {"kernel": RUNTIME_KERNELS["int4"], "rows": 1, "us": 300.0, "weight_bytes": 3000},
            {"kernel": "torch int4pack (bf16 act)", "rows": 1, "us": 1.0, "weight_bytes": 10**9}]
    assert keep_rates(rows) == ["int4"]
    assert load_rates("int4", torch.get_num_threads()) == {1: pytest.approx(4000 / 400e-6)}


def test_plan_by_a_name_not_here_says_what_to_run(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A catalogue name (or Hub id) that is not on this machine and whose config.json does not ship with
    specexec: the line gives the commands that fetch the one file plan needs and plan it; run as given, they work.
    (llama-3.1-70b-instruct's ships: plan reads it, tests/checkpoints/test_models_yaml.py.)"""
    import re
    import shlex
    import shutil

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("SPECEXEC_MODEL_DIRS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "llama-3.3-70b-instruct"]) == 2
    err = capsys.readouterr().err.strip()
    fetch, again = re.findall(r"`([^`]+)`", err)
    assert fetch.startswith("hf download meta-llama/Llama-3.3-70B-Instruct config.json --local-dir ")
    local = Path(shlex.split(fetch)[-1])
    local.mkdir()                                       # what `hf download ... --local-dir` leaves
    shutil.copy(Path(LLAMA_70B) / "config.json", local / "config.json")
    assert main(shlex.split(again)[1:] + ["--ram-budget", "24GB"]) == 0
