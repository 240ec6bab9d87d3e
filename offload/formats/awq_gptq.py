"""Read AWQ and GPTQ checkpoints (group-wise int4 packed in int32) as a checkpoint source of dense weights.

`PackedCheckpoint(directory, quant_config)` wraps the safetensors files of a checkpoint whose config.json has a
`quantization_config` (or an AutoGPTQ `quantize_config.json`) and shows every packed linear `X.qweight` (+
`X.qzeros`, `X.scales`, GPTQ's `X.g_idx`) as the dense `X.weight` [out, in], dequantized on get() to float32
with torch ops on CPU: (q - z) * s is exact in float32 (fp16 scale times an int4 difference), so the only
rounding is the caller's single cast to its dtype (and the cache's requantization, if it asks for one).
Every other tensor (norms, embeddings, biases, unquantized modules) passes through as stored.

Layouts, as the writers define them:
  AutoAWQ GEMM:  qweight int32 [in, out/8] packed along OUT in the order AWQ_ORDER; qzeros int32
                 [groups, out/8] same packing; scales [groups, out]; group of input row i = i // group_size.
  AutoGPTQ/GPTQModel: qweight int32 [in*bits/32, out] packed along IN, low bits first; qzeros int32
                 [groups, out*bits/32] packed along OUT; scales [groups, out]; g_idx int32 [in] = the group of
                 each input row (act-order / desc_act gives any map, handled by a gather). checkpoint_format
                 "gptq" (v1) stores zero - 1: dequantized as AutoGPTQ does, z = (stored & mask) + 1; "gptq_v2"
                 stores z. sym and asym differ only in the stored zeros.
Anything else (other AWQ versions, 3-bit GPTQ, Marlin/exllama repacks, per-module "dynamic" overrides,
other quant methods) fails in parse_quant_config with what is supported.

`PackedLinear` keeps the packed tensors and dequantizes on every forward (the "keep packed" option, for
measurements and a future packed cache format); the loaders use the dense source.

Does not know: model architectures (names are only rewritten qweight -> weight), the layer cache, devices.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from offload.formats.checkpoint import ST_DTYPES, CheckpointError, SafetensorsCheckpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # AutoAWQ GEMM: nibble i of each int32 holds column AWQ_ORDER[i]
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)      # column k of each group of 8 sits in nibble AWQ_REVERSE[k]
METHODS = ("awq", "gptq")
GPTQ_BITS = (2, 4, 8)                        # bit widths that tile an int32 (3-bit straddles words)
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_VERSIONS = ("gemm",)
PACKED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
CHUNK_ELEMENTS = 1 << 24                     # dequantize this many weights at a time (bounds temporaries)


@dataclass(frozen=True)
class QuantScheme:
    """What the packed tensors mean: method, bits, group size (-1 = one group), GPTQ zero offset."""
    method: str
    bits: int
    group_size: int
    zero_offset: int = 0          # GPTQ v1 stores zero - 1
    desc_act: bool = False

    def describe(self) -> str:
        group = "per-channel" if self.group_size < 0 else f"group {self.group_size}"
        return f"{self.method} {self.bits}-bit {group}" + (" act-order" if self.desc_act else "")


def read_quant_config(directory: Path) -> dict[str, Any] | None:
    """config.json's quantization_config, else AutoGPTQ's quantize_config.json, else None."""
    cfg_file = directory / "config.json"
    if cfg_file.is_file():
        try:
            qc = json.loads(cfg_file.read_text()).get("quantization_config")
        except (ValueError, AttributeError, UnicodeDecodeError):
            qc = None                          # config.json's own errors are reported by the config reader
        if qc:
            return qc
    legacy = directory / "quantize_config.json"
    if legacy.is_file():
        try:
            qc = json.loads(legacy.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{legacy} is not valid JSON ({e})") from None
        return {"quant_method": "gptq", **qc} if isinstance(qc, dict) else None
    return None


def parse_quant_config(qc: dict[str, Any], where: str) -> QuantScheme:
    """The scheme of a quantization_config, or CheckpointError naming the unsupported part."""
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise CheckpointError(f"{where}: quantization_config quant_method {method or None!r} is not supported; "
                              "supported: awq (AutoAWQ GEMM), gptq (AutoGPTQ / GPTQModel), mxfp4 (gpt-oss), or "
                              "unquantized weights")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group == 0 or group < -1:
        raise CheckpointError(f"{where}: {method} group_size {group} is invalid; use -1 or a positive size")
    if method == "awq":
        return _awq_scheme(qc, bits, group, where)
    return _gptq_scheme(qc, bits, group, where)


def _awq_scheme(qc: dict[str, Any], bits: int, group: int, where: str) -> QuantScheme:
    version = str(qc.get("version", "gemm")).lower()
    if version not in AWQ_VERSIONS:
        raise CheckpointError(f"{where}: AWQ version {version!r} is not supported; supported: "
                              f"{', '.join(AWQ_VERSIONS)} (AutoAWQ's default packing)")
    if bits != 4:
        raise CheckpointError(f"{where}: AWQ with {bits} bits is not supported; supported: 4")
    if not qc.get("zero_point", True):
        raise CheckpointError(f"{where}: AWQ without zero points (zero_point: false) is not supported; "
                              "supported: zero_point true")
    return QuantScheme("awq", 4, group)


def _gptq_scheme(qc: dict[str, Any], bits: int, group: int, where: str) -> QuantScheme:
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in GPTQ_FORMATS:
        raise CheckpointError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported; supported: "
                              f"{', '.join(GPTQ_FORMATS)} (AutoGPTQ / GPTQModel's own packing)")
    if bits not in GPTQ_BITS:
        raise CheckpointError(f"{where}: GPTQ with {bits} bits is not supported; supported: "
                              f"{', '.join(map(str, GPTQ_BITS))}")
    if qc.get("dynamic"):
        raise CheckpointError(f"{where}: GPTQ per-module 'dynamic' overrides are not supported; supported: one "
                              "bits/group_size for every module")
    return QuantScheme("gptq", bits, group, 1 if fmt == "gptq" else 0, bool(qc.get("desc_act", False)))


# ----------------------------------------------------------------------------------------- unpacking

def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> int32 values, 32/bits per word, low bits first, expanded along `dim` (0 or 1)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:
        vals = packed.unsqueeze(1) >> shifts.view(1, per, 1)          # [R, per, C]
        return (vals & ((1 << bits) - 1)).reshape(packed.shape[0] * per, packed.shape[1])
    vals = packed.unsqueeze(2) >> shifts.view(1, 1, per)              # [R, C, per]
    return (vals & ((1 << bits) - 1)).reshape(packed.shape[0], packed.shape[1] * per)


def awq_columns(values: torch.Tensor) -> torch.Tensor:
    """Undo AutoAWQ's GEMM column interleave on unpacked values [R, C] (C a multiple of 8)."""
    order = torch.arange(values.shape[1]).view(-1, 8)[:, list(AWQ_REVERSE)].reshape(-1)
    return values[:, order]


def dequantize(scheme: QuantScheme, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """float32 W [out, in] of one packed linear, computed CHUNK_ELEMENTS weights at a time."""
    zeros = unpack(qzeros.to(torch.int32), scheme.bits, 1)
    if scheme.method == "awq":
        zeros, n_in = awq_columns(zeros), qweight.shape[0]
    else:
        zeros, n_in = zeros + scheme.zero_offset, qweight.shape[0] * 32 // scheme.bits
    default = _default_groups(n_in, scheme.group_size)
    groups = None if g_idx is None or torch.equal(g_idx.long(), default) else g_idx.long()
    n_out = scales.shape[1]
    out = torch.empty(n_out, n_in, dtype=torch.float32)
    per = 32 // scheme.bits
    step = max(per, CHUNK_ELEMENTS // max(n_in, 1) // per * per)          # output columns per chunk
    for c0 in range(0, n_out, step):
        c1 = min(c0 + step, n_out)
        q = _unpacked_columns(scheme, qweight, c0, c1)                   # [in, c1-c0]
        out[c0:c1] = _scaled(q, zeros[:, c0:c1], scales[:, c0:c1], groups if groups is not None else default,
                             scheme.group_size if groups is None else 0).t()
    return out


def _scaled(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor,
            group_size: int) -> torch.Tensor:
    """(q - z) * s as float32 [in, C]: contiguous groups broadcast their row of zeros/scales; any other
    grouping (act-order g_idx, a ragged last group) gathers one row per input row."""
    n_in, n_cols = q.shape
    if group_size > 0 and n_in % group_size == 0:
        q = q.view(n_in // group_size, group_size, n_cols)
        w = (q - zeros.unsqueeze(1)).float().mul_(scales.float().unsqueeze(1))
        return w.view(n_in, n_cols)
    return (q - zeros[groups]).float().mul_(scales.float()[groups])


def _unpacked_columns(scheme: QuantScheme, qweight: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
    """Unpacked int values [in, c1-c0] of output columns c0:c1."""
    qweight = qweight.to(torch.int32)
    if scheme.method == "awq":                                   # packed along out: 8 columns per word
        return awq_columns(unpack(qweight[:, c0 // 8:(c1 + 7) // 8], 4, 1))[:, : c1 - c0]
    return unpack(qweight[:, c0:c1], scheme.bits, 0)


def _default_groups(n_in: int, group_size: int) -> torch.Tensor:
    if group_size < 0:
        return torch.zeros(n_in, dtype=torch.long)
    return torch.arange(n_in) // group_size


# ----------------------------------------------------------------------------------------- the source

class PackedCheckpoint:
    """Name -> dense tensor access over an AWQ or GPTQ safetensors checkpoint (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, quant_config: dict[str, Any] | None = None) -> None:
        self.directory = Path(directory)
        qc = quant_config if quant_config is not None else read_quant_config(self.directory)
        if qc is None:
            raise CheckpointError(f"{self.directory} has no quantization_config in config.json")
        self.scheme = parse_quant_config(qc, str(self.directory))
        self.format = self.scheme.method
        self.ckpt = SafetensorsCheckpoint(self.directory)
        self._stored = frozenset(self.ckpt.names())
        self._packed = self._find_packed()            # dense name "X.weight" -> prefix "X"
        self._shapes = {name: self._dense_shape(prefix) for name, prefix in self._packed.items()}
        self._names = [n for n in self.ckpt.names() if not n.endswith(PACKED_SUFFIXES)] + list(self._packed)

    def _find_packed(self) -> dict[str, str]:
        stored = self._stored
        packed = {}
        for name in sorted(stored):
            if not name.endswith(".qweight"):
                continue
            prefix = name.removesuffix(".qweight")
            needed = [f"{prefix}.qzeros", f"{prefix}.scales"]
            missing = [n for n in needed if n not in stored]
            if missing:
                raise CheckpointError(f"{self.directory}: {name} has no {missing[0]} ({self.scheme.describe()})")
            if f"{prefix}.weight" in stored:
                raise CheckpointError(f"{self.directory}: both {name} and {prefix}.weight are stored")
            packed[f"{prefix}.weight"] = prefix
        if not packed:
            raise CheckpointError(f"{self.directory}: config.json says {self.scheme.method} but no tensor is "
                                  "packed (no *.qweight)")
        return packed

    def _dense_shape(self, prefix: str) -> tuple[int, int]:
        """(out, in) of a packed linear, checked against its scales, zeros and g_idx."""
        s, bits = self.scheme, self.scheme.bits
        qw, qz, sc = (tuple(self.ckpt.shape(f"{prefix}.{k}")) for k in ("qweight", "qzeros", "scales"))
        n_out, n_in = (qw[1] * 8, qw[0]) if s.method == "awq" else (qw[1], qw[0] * 32 // bits)
        groups = 1 if s.group_size < 0 else -(-n_in // s.group_size)
        want = {"scales": (groups, n_out), "qzeros": (groups, n_out * bits // 32)}
        g_name = f"{prefix}.g_idx"
        if s.method == "gptq" and g_name in self._stored:
            want["g_idx"] = (n_in,)
        for key, shape in want.items():
            got = {"scales": sc, "qzeros": qz}.get(key) or tuple(self.ckpt.shape(g_name))
            if got != shape:
                raise CheckpointError(f"{self.directory}: {prefix}.{key} has shape {list(got)}; a {s.describe()} "
                                      f"linear of [{n_out}, {n_in}] needs {list(shape)}")
        return n_out, n_in

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name] if name in self._shapes else self.ckpt.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        """float32 for a dequantized weight, else the stored dtype (read from the header)."""
        return torch.float32 if name in self._packed else stored_dtype(self.ckpt, name)

    def get(self, name: str) -> torch.Tensor:
        """One tensor: a packed linear's weight dequantized to float32 [out, in], anything else as stored."""
        if name not in self._packed:
            return self.ckpt.get(name)
        prefix = self._packed[name]
        parts = {k: self.ckpt.get(f"{prefix}.{k}") for k in ("qweight", "qzeros", "scales")}
        g_idx = self.ckpt.get(f"{prefix}.g_idx") if f"{prefix}.g_idx" in self._stored else None
        if g_idx is not None:
            groups = parts["scales"].shape[0]
            if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
                raise CheckpointError(f"{self.directory}: {prefix}.g_idx holds groups "
                                      f"{int(g_idx.min())}..{int(g_idx.max())}, the scales have {groups}")
        return dequantize(self.scheme, parts["qweight"], parts["qzeros"], parts["scales"], g_idx)

    def packed(self, name: str) -> dict[str, torch.Tensor]:
        """The stored parts of a packed linear's weight (qweight, qzeros, scales, g_idx?) for PackedLinear."""
        prefix = self._packed[name]
        keys = ("qweight", "qzeros", "scales", "g_idx")
        return {k: self.ckpt.get(f"{prefix}.{k}") for k in keys if f"{prefix}.{k}" in self._stored}


def stored_dtype(ckpt: SafetensorsCheckpoint, name: str) -> torch.dtype:
    """The dtype of a safetensors tensor, from its file's header (nothing read)."""
    if name not in ckpt._where:
        raise CheckpointError(f"{ckpt.directory}: tensor {name!r} is missing")
    code = ckpt._open(ckpt._where[name]).get_slice(name).get_dtype()
    if code not in ST_DTYPES:
        raise CheckpointError(f"{ckpt.directory}: tensor {name} has dtype {code}, which this runtime cannot read")
    return ST_DTYPES[code]


# ----------------------------------------------------------------------------------------- packed linear

class PackedLinear(nn.Module):
    """A linear layer that keeps AWQ/GPTQ packed int weights and dequantizes them on every forward (torch
    ops; one dequantization per call, any number of tokens, then one GEMM in x's dtype)."""

    def __init__(self, scheme: QuantScheme, parts: dict[str, torch.Tensor], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.scheme = scheme
        for key in ("qweight", "qzeros", "scales", "g_idx"):
            self.register_buffer(key, parts.get(key))
        self.register_buffer("bias", bias)

    def weight(self) -> torch.Tensor:
        """Dense float32 [out, in]."""
        return dequantize(self.scheme, self.qweight, self.qzeros, self.scales, self.g_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight().to(x.dtype), bias)
