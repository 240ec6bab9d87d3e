"""Path -> the right checkpoint source: a safetensors directory, an AWQ/GPTQ or MXFP4 directory, or a .gguf file.

Every source has the same small interface, which is all the loaders (and the layer cache) need:

    names() -> list[str]                 HF tensor names ("model.layers.0.self_attn.q_proj.weight", ...)
    shape(name) -> tuple[int, ...]       the dense shape get() returns
    get(name) -> torch.Tensor            one CPU tensor, dense (quantized formats are dequantized to float32)
    format: str                          "safetensors" | "awq" | "gptq" | "mxfp4" | "gguf" (manifests, messages)
    get_index(name, i) (optional)        get(name)[i] reading only that slice (one expert of a fused tensor)

`tensor_specs(source)` adds the dtype of each tensor (from headers, nothing read) for planning sizes. A .gguf
source also has config() (a config.json-like dict) and fingerprint() (what offload.cache.identity records of
it); the directory sources keep their config.json.

Does not know: ModelArgs, tokenizers, pickle checkpoints (specexec.checkpoints.loading refuses or reads those itself).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import torch

from offload.formats.awq_gptq import PackedCheckpoint, parse_quant_config, read_quant_config, stored_dtype
from offload.formats.checkpoint import CheckpointError, SafetensorsCheckpoint

FORMATS = ("safetensors", "awq", "gptq", "mxfp4", "gguf")
GGUF_SUFFIX = ".gguf"


class CheckpointSource(Protocol):
    format: str

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str) -> torch.Tensor: ...


def is_gguf(path: str | os.PathLike) -> bool:
    """A regular file named *.gguf or starting with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == GGUF_SUFFIX:
        return True
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def detect_format(path: str | os.PathLike) -> str:
    """'gguf' for a GGUF file; for a directory 'awq' / 'gptq' / 'mxfp4' by its quantization config, else
    'safetensors'.
    CheckpointError for a quantization method this runtime cannot read."""
    p = Path(path)
    if is_gguf(p):
        return "gguf"
    if p.is_file():
        raise CheckpointError(f"{p} is a file but not a GGUF file; pass a checkpoint directory or a .gguf file")
    qc = read_quant_config(p)
    if qc is None:
        return "safetensors"
    if str(qc.get("quant_method", "")).lower() == "mxfp4":
        return "mxfp4"
    return parse_quant_config(qc, str(p)).method


def open_source(path: str | os.PathLike) -> CheckpointSource:
    """The source for `path` (see detect_format)."""
    fmt = detect_format(path)
    if fmt == "gguf":
        from offload.formats.gguf import open_gguf
        return open_gguf(path)
    if fmt in ("awq", "gptq"):
        return PackedCheckpoint(path)
    if fmt == "mxfp4":
        from offload.formats.mxfp4 import MXFP4Checkpoint
        return MXFP4Checkpoint(path)
    ckpt = SafetensorsCheckpoint(path)
    ckpt.format = "safetensors"
    return ckpt


def tensor_specs(source: CheckpointSource) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Tensor name -> (dtype get() returns, shape), without reading any tensor data."""
    if hasattr(source, "dtype"):
        return {n: (source.dtype(n), tuple(source.shape(n))) for n in source.names()}
    return {n: (stored_dtype(source, n), tuple(source.shape(n))) for n in source.names()}
