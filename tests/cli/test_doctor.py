"""`specexec doctor` on this CPU-only machine: it says there is no CUDA, measures the cache directory's disk
with a temporary file it removes, reports RAM and bitsandbytes, and checks the CPU path (resident vs streamed
greedy tokens of a tiny model); --json is one line with every section; a mismatch fails the command."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import cli.doctor as doctor
from cli.main import main

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only report")


def _private_rates(monkeypatch, tmp_path: Path) -> None:
    """doctor keeps the disk's measured rate for `plan`; here in tmp_path, so no plan of the session reads it."""
    monkeypatch.setattr("specexec.tuning.disk_rate.store_path", lambda kind, fp: tmp_path / "rates" / f"{fp}.json")


@cpu_only
def test_cpu_report_and_json_shape(capsys, tmp_path: Path, monkeypatch) -> None:
    from specexec.tuning.disk_rate import measured_read_gbps

    _private_rates(monkeypatch, tmp_path)
    disk = tmp_path / "cache"
    assert main(["doctor", "--json", "--io-mb", "4", "--cache-dir", str(disk)]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1
    r = json.loads(out)
    assert set(r) == {"version", "cuda", "disk", "bitsandbytes", "ram", "tiny_model", "ok"} and r["ok"] is True
    assert r["cuda"]["cuda_available"] is False and r["cuda"]["gpus"] == [] and r["cuda"]["torch"] == torch.__version__
    assert r["disk"]["ok"] and r["disk"]["read_gbps"] > 0 and r["disk"]["dir"] == str(disk)
    assert list(disk.iterdir()) == []                                  # the probe's file is gone
    kept = measured_read_gbps(disk)                                    # what `specexec plan` prices the SSD with
    assert kept is not None and kept.gbps == pytest.approx(r["disk"]["read_gbps"], abs=0.006)
    assert r["bitsandbytes"]["cuda_kernels"] is None and r["ram"]["available_bytes"] > 0
    t = r["tiny_model"]
    assert t["device"] == "cpu" and t["tokens"] > 0 and t["equal"] == {"cpu resident": True, "cpu streamed (ssd)": True}
    words = doctor.tiny_model_words(t)
    assert words == (f"the CPU streaming its layers from the SSD tier gives the same {t['tokens']} greedy tokens "
                     "as the CPU with every layer resident")


@cpu_only
def test_text_report_and_a_mismatch_fails(capsys, tmp_path: Path, monkeypatch) -> None:
    _private_rates(monkeypatch, tmp_path)
    real = doctor._tokens
    monkeypatch.setattr(doctor, "_tokens", lambda t, d, dev, cache, offload: real(t, d, dev, cache, offload)
                        + ([0] if offload == "ssd" else []))
    assert main(["doctor", "--io-mb", "4", "--cache-dir", str(tmp_path)]) == 1
    text = capsys.readouterr().out
    assert "no CUDA device: checking the CPU path only" in text
    assert ("the CPU streaming its layers from the SSD tier gives OTHER tokens than the CPU with every layer "
            "resident (a bug: please report it)") in text
    assert "some checks FAILED" in text and "read" in text and "GB/s" in text


def test_on_cuda_a_missing_bitsandbytes_fails_the_doctor(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """--quant auto means NF4 (bitsandbytes' kernels) on CUDA: a CUDA machine without bitsandbytes must not pass
    (it did: a missing package read as 'not applicable'). Without CUDA it stays not applicable."""
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)              # `import bitsandbytes` raises
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    assert doctor.bnb_report()["cuda_kernels"] is None                  # no CUDA here: not applicable
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    b = doctor.bnb_report()
    assert b["version"] is None and b["cuda_kernels"] is False and "pip install bitsandbytes" in b["hint"]
    fine = {"ok": True}
    monkeypatch.setattr(doctor, "cuda_report", lambda mb: {"torch": "x", "python": "3", "cuda_available": False})
    monkeypatch.setattr(doctor, "disk_report", lambda d, mb: fine)
    monkeypatch.setattr(doctor, "ram_report", lambda: {})
    monkeypatch.setattr(doctor, "tiny_model_report", lambda: fine)
    assert doctor.collect(Path("."), 1, 1)["ok"] is False


def test_bad_flags_are_one_line(capsys, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert main(["doctor", "--io-mb", "0"]) == 2
    assert main(["doctor", "--cache-dir", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert "--io-mb must be in" in err and "is not a directory" in err


@pytest.mark.gpu
def test_gpu_doctor_is_fast_pinned_beats_pageable_and_the_gpu_equals_the_cpu(capsys, tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    import time

    t0 = time.perf_counter()
    assert main(["doctor", "--json", "--cache-dir", str(tmp_path)]) == 0
    assert time.perf_counter() - t0 < 60
    r = json.loads(capsys.readouterr().out)
    assert r["cuda"]["gpus"] and r["cuda"]["h2d_gbps"]["pinned"] > r["cuda"]["h2d_gbps"]["pageable"]
    assert r["bitsandbytes"]["cuda_kernels"] is True
    assert r["tiny_model"]["equal"] == {"cpu resident": True, "cuda resident": True, "cuda streamed (ssd)": True}


def test_no_foreign_noise_on_stderr() -> None:
    """bitsandbytes' CPU backend logs, on import, that an optional hub kernel it tries to fetch is missing or
    untrusted; doctor (which imports it to report its version) shows none of that."""
    import subprocess
    import sys

    code = ("import logging, sys; logging.basicConfig(stream=sys.stderr); import cli.doctor as d; "
            "r = d.bnb_report(); print(r['version'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() not in ("", "None"), out.stderr
    assert "kernels-community" not in out.stderr and "gemm_4bit" not in out.stderr, out.stderr
