"""GGUF and AWQ/GPTQ targets through the offloaded runtime: the layer cache builds from any checkpoint source
(offload.formats.sources), records the source format in its manifest, and the streamed target decodes exactly as the
same weights from a plain safetensors checkpoint at the same quantization."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specexec.config import EngineConfig, OffloadConfig, SamplingParams
from specexec.runtime.assembly import Runtime
from tests.offload.formats.gguf_writer import write_gguf
from tests.offload.formats.awq_gptq_writer import VARIANTS, write_packed

pytest.importorskip("gguf")


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECEXEC_CACHE", str(tmp_path / "cache"))


def _greedy(model: Path, draft: Path, offload: OffloadConfig) -> tuple[list[int], Runtime]:
    rt = Runtime.load(str(model), str(draft), EngineConfig(budget=8, max_new_tokens=16), offload=offload)
    ids = rt.tokenizer("Hello there, how are")["input_ids"]
    out = [t for step in rt.generate_ids(ids, 16, SamplingParams()) for t in step]
    return out, rt


@pytest.mark.parametrize("quant,tier", [("nf4", "ssd"), ("none", "ram")])
def test_gguf_target_streams_like_the_safetensors_target(tiny_llama: Path, tmp_path: Path, quant: str,
                                                         tier: str) -> None:
    gguf_file = write_gguf(tiny_llama, tmp_path / "m.gguf", "F32")
    offload = OffloadConfig(quant=quant, offload=tier)
    got, rt = _greedy(gguf_file, tiny_llama, offload)
    want, _ = _greedy(tiny_llama, tiny_llama, offload)
    assert got == want and len(got) > 0
    manifest = json.loads(next((tmp_path / "cache").glob("m.gguf-*/manifest.json")).read_text())
    assert manifest["source_format"] == "gguf"


@pytest.mark.parametrize("name", ["awq", "gptq-act-order"])
def test_packed_target_streams_like_its_dense_reference(name: str, tiny_llama: Path, tmp_path: Path) -> None:
    packed, dense = write_packed(tiny_llama, tmp_path, VARIANTS[name])
    offload = OffloadConfig(quant="nf4", offload="ssd")
    got, _ = _greedy(packed, tiny_llama, offload)
    want, _ = _greedy(dense, tiny_llama, offload)
    assert got == want and len(got) > 0
    manifests = [json.loads(m.read_text()) for m in (tmp_path / "cache").glob("*/manifest.json")]
    assert sorted(m["source_format"] for m in manifests) == sorted([VARIANTS[name].method, "safetensors"])
