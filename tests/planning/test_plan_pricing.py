"""What `specexec plan` prices beyond the copies: the GPU's own compute (a wholly resident target is not free), a
draft that crowds the target out of the GPU (the plan says what --draft-quant would keep resident), and the SSD
rate `specexec doctor` measured on the cache root's disk (said as measured, else as assumed)."""
from __future__ import annotations

import re

import pytest

from cli.main import main

CUDA_24 = ["--device", "cuda", "--gpu-memory", "24GB", "--ram-budget", "16GB", "--dtype", "bfloat16"]


def _plan(capsys, *argv: str) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_a_wholly_resident_target_is_priced_by_the_gpu_s_reads(capsys) -> None:
    out = _plan(capsys, "--model", "qwen3.5-35b-a3b", "--device", "cuda", "--gpu-memory", "80GB")
    line = next(x for x in out.splitlines() if x.startswith("predicted "))
    assert "40 of 40 layers resident" in line and "the GPU's compute" in line, line
    seconds = float(re.match(r"predicted ([\d.]+) s", line).group(1))
    assert 0.02 < seconds < 0.2, line                     # ~42 GB at 900 GB/s, not 0.000
    faster = _plan(capsys, "--model", "qwen3.5-35b-a3b", "--device", "cuda", "--gpu-memory", "80GB",
                   "--gpu-gbps", "1800")
    halved = float(re.search(r"^predicted ([\d.]+) s", faster, re.M).group(1))
    assert abs(halved - seconds / 2) <= 0.001, (seconds, halved)        # twice the bandwidth, half the seconds


def test_a_draft_that_crowds_out_the_target_gets_the_quantized_draft_s_count(capsys) -> None:
    out = _plan(capsys, "--model", "llama-3.1-70b-instruct", "--draft", "llama-3.1-8b-instruct", *CUDA_24)
    hint = next(x for x in out.splitlines() if x.startswith("the draft crowds out the target"))
    resident = re.search(r"keeps (\d+) of 80 target layers resident instead of (\d+)", hint)
    assert "--draft-quant nf4" in hint and int(resident.group(1)) > int(resident.group(2)), hint
    quantized = _plan(capsys, "--model", "llama-3.1-70b-instruct", "--draft", "llama-3.1-8b-instruct",
                      "--draft-quant", "nf4", *CUDA_24)
    assert "crowds out" not in quantized and f"{resident.group(1)} of 80 layers resident" in quantized


def test_the_ssd_rate_is_doctor_s_measurement_when_it_ran(capsys, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specexec.tuning.disk_rate import save_read_gbps

    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "cache"))
    assumed = _plan(capsys, "--model", "llama-3.1-70b-instruct", *CUDA_24)
    assert "SSD 3.00 GB/s, assumed (`specexec doctor` measures this disk" in assumed
    save_read_gbps(tmp_path / "cache", 1.92)                 # what doctor keeps after its disk probe
    measured = _plan(capsys, "--model", "llama-3.1-70b-instruct", *CUDA_24)
    assert "SSD 1.92 GB/s, measured by `specexec doctor` on " in measured
    assert "SSD 3.00 GB/s" in _plan(capsys, "--model", "llama-3.1-70b-instruct", *CUDA_24, "--ssd-gbps", "3")
