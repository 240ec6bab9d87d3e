"""Read a llama.cpp GGUF file as a checkpoint source: Hugging Face tensor names, dequantized tensor by tensor.

`GGUFCheckpoint(path)` has the same names()/shape(name)/get(name) as
offload.formats.checkpoint.SafetensorsCheckpoint, under HF names (token_embd -> model.embed_tokens, blk.N.attn_q ->
model.layers.N.self_attn.q_proj, ..., output -> lm_head; no `output` tensor means tied embeddings; the table per
architecture, and what each one's metadata and stored values mean, is offload/formats/gguf_arch.py). A mixture of
experts' merged expert tensors (blk.N.ffn_*_exps) show as the family's per-expert Hub names, each one expert's slice
of the file (the expert is the outermost dimension, so a slice is whole quant blocks). get() dequantizes ONE tensor
to float32 (the caller casts once, as transformers does), in row chunks so a quantized tensor's numpy temporaries
stay small; the file itself is only memory-mapped, so the model is never in RAM at once. llama.cpp stores the Q/K
weights (and biases) of Llama/Mistral permuted for its rope layout; they are un-permuted here (not for Qwen2/Qwen3,
which llama.cpp leaves alone), and Gemma's norm weights lose the 1 llama.cpp added. `config()` builds a
config.json-like dict from the file's metadata, so the usual specexec.families.model_args validates it; a Llama-3
`rope_freqs` tensor becomes HF's llama3 rope_scaling.

The file's header is parsed here (gguf's GGUFReader takes ~25 s on a 150k-token vocabulary, this ~0.5 s);
the `gguf` package (optional extra `gguf`) supplies the quant types and their numpy dequantizers.

Does not know: tokenizers (specexec.runtime.tokenizer builds one from the same file), ModelArgs, quantization for
the cache, devices.
"""
from __future__ import annotations

import hashlib
import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offload.formats.checkpoint import CheckpointError
from offload.formats.gguf_arch import (ARCH_METADATA_KEYS, ARCHS, METADATA_KEYS, NOT_WEIGHTS, JoinedKV, arch_config,
                                       head_dim_of, hub_names, join_kv_b, joined_kv_b)

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
CHUNK_ELEMENTS = 1 << 20            # elements per numpy dequantize call: bounds temporaries, stays in cache

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                   "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                   "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0")


def _gguf():
    """The `gguf` package, imported lazily with an install hint."""
    try:
        import gguf
    except ImportError:
        raise CheckpointError("reading GGUF files needs the `gguf` package: pip install -e '.[gguf]' "
                              "(or pip install gguf)") from None
    return gguf


# ----------------------------------------------------------------------------------------- file header

@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: GGUF name, ggml dims (ne0 = the contiguous one first), type, file offset."""
    name: str
    dims: tuple[int, ...]
    qtype: int
    offset: int           # absolute, in bytes
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The torch/HF shape: ggml dims reversed ([out, in] for a weight)."""
        return tuple(reversed(self.dims))


class _Reader:
    """Little-endian cursor over the mapped file."""

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                12: "<d"}
    _NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
              11: "<i8", 12: "<f8"}

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise CheckpointError(f"{self.path}: GGUF header ends early at byte {self.pos}; the file is "
                                  "truncated or not a GGUF file") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise CheckpointError(f"{self.path}: GGUF string at byte {self.pos} runs past the end of the file")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in self._SCALARS:
            return self.scalar(self._SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype != 9:
            raise CheckpointError(f"{self.path}: unknown GGUF metadata type {vtype} at byte {self.pos}")
        etype, n = self.scalar("<I"), self.scalar("<Q")
        if etype in self._NUMPY:
            width = np.dtype(self._NUMPY[etype]).itemsize
            if self.pos + n * width > len(self.buf):
                raise CheckpointError(f"{self.path}: GGUF array at byte {self.pos} runs past the end of the file")
            arr = np.frombuffer(self.buf, dtype=self._NUMPY[etype], count=n, offset=self.pos)
            self.pos += n * width
            return arr.tolist()
        return [self.value(etype) for _ in range(n)]


def read_header(buf: mmap.mmap, path: Path, file_size: int) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """(metadata, GGUF tensor name -> TensorInfo) of a mapped GGUF file (version 2 or 3, little-endian)."""
    r = _Reader(buf, path)
    if bytes(buf[:4]) != MAGIC:
        raise CheckpointError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    r.pos = 4
    version = r.scalar("<I")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise CheckpointError(f"{path}: GGUF version {version}{hint} is not supported; supported: 2, 3 (little-endian)")
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    meta = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.scalar("<I"))
    raw = []
    for _ in range(n_tensors):
        name, n_dims = r.string(), r.scalar("<I")
        dims = tuple(r.scalar("<Q") for _ in range(n_dims))
        raw.append((name, dims, r.scalar("<I"), r.scalar("<Q")))
    align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
    start = (r.pos + align - 1) // align * align
    tensors = {name: _tensor_info(path, name, dims, qtype, start + off, file_size) for name, dims, qtype, off in raw}
    return meta, tensors


def _tensor_info(path: Path, name: str, dims: tuple[int, ...], qtype: int, offset: int, file_size: int) -> TensorInfo:
    sizes = _gguf().GGML_QUANT_SIZES
    kind = _type_name(qtype)
    if kind not in SUPPORTED_TYPES or not any(int(t) == qtype for t in sizes):
        raise CheckpointError(f"{path}: tensor {name} has GGUF quant type {kind}, which this runtime cannot "
                              f"dequantize; supported: {', '.join(SUPPORTED_TYPES)}")
    block, type_size = next(v for t, v in sizes.items() if int(t) == qtype)
    if not dims or dims[0] % block:
        raise CheckpointError(f"{path}: tensor {name} has dims {list(dims)}, not whole {kind} blocks of {block}")
    nbytes = math.prod(dims) // block * type_size
    if offset + nbytes > file_size:
        raise CheckpointError(f"{path}: tensor {name} ends at byte {offset + nbytes}, past the end of the "
                              f"file ({file_size} bytes); the file is truncated")
    return TensorInfo(name, dims, qtype, offset, nbytes)


def _type_name(qtype: int) -> str:
    try:
        return _gguf().GGMLQuantizationType(qtype).name
    except ValueError:
        return f"id {qtype} (unknown to the installed gguf package)"


# ----------------------------------------------------------------------------------------- names

def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's `permute(w, n_head, n_head_kv)` of Q/K rows (weight [out, in] or bias [out]): it stored
    each head's rotary halves interleaved; HF keeps them as two halves."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


# ----------------------------------------------------------------------------------------- the source

class GGUFCheckpoint:
    """HF name -> tensor access over one GGUF file (memory-mapped; one tensor dequantized per get())."""

    format = "gguf"

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 24:
                    raise CheckpointError(f"{self.path} has {size} bytes: too short for a GGUF file")
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read it ({e.strerror or e})") from None
        self.meta, self._raw = read_header(self._buf, self.path, size)
        self.arch = str(self.meta.get("general.architecture", ""))
        if self.arch not in ARCHS:
            raise CheckpointError(f"{self.path}: GGUF architecture {self.arch!r} is not supported; supported: "
                                  f"{', '.join(ARCHS)} (Mistral files say 'llama')")
        self.n_experts = int(self.meta.get(f"{self.arch}.expert_count", 0) or 0)
        self._where = self._map_names()
        self._config: dict[str, Any] | None = None

    def _map_names(self) -> dict[str, TensorInfo | JoinedKV]:
        where: dict[str, TensorInfo | JoinedKV] = {}
        parts: dict[str, dict[str, TensorInfo]] = {}   # target -> its halves
        for name, info in self._raw.items():
            if name in NOT_WEIGHTS:
                continue
            pieces = hub_names(name, self.arch, self.n_experts)
            if pieces is None and not self.n_experts and re.search(r"\.ffn_\w*(exps|inp)\.", name):
                raise CheckpointError(f"{self.path}: tensor {name!r} holds experts, but the file declares no "
                                      f"{self.arch}.expert_count; it is not a model this runtime reads")
            if pieces is None:
                raise CheckpointError(f"{self.path}: tensor {name!r} is not part of a {self.arch} decoder as this "
                                      "runtime reads it (token_embd, blk.N.attn_*/ffn_{gate,up,down}/*_norm, merged "
                                      "experts blk.N.ffn_gate_inp and ffn_{gate,up,down}_exps, output_norm, output)")
            for target, piece in pieces.items():
                if piece.part is not None:
                    parts.setdefault(target, {})[piece.part] = info
                else:
                    where[target] = info if piece.expert is None else self._expert_slice(info, piece.expert)
        for target, halves in parts.items():
            if target not in where:                     # a file with the whole kv_b too reads that one
                where[target] = joined_kv_b(self.path, target, halves)
        if "model.embed_tokens.weight" not in where:
            raise CheckpointError(f"{self.path}: no token_embd.weight tensor; not a complete model file")
        return where

    def _expert_slice(self, info: TensorInfo, expert: int) -> TensorInfo:
        """Expert `expert` of a merged [E, out, in] tensor: its own contiguous bytes (whole quant blocks)."""
        if len(info.dims) != 3 or info.dims[-1] != self.n_experts:
            raise CheckpointError(f"{self.path}: merged expert tensor {info.name} has dims {list(info.dims)}; "
                                  f"expected [in, out, {self.n_experts}] (expert_count experts outermost)")
        per = info.nbytes // self.n_experts
        return TensorInfo(f"{info.name}[{expert}]", info.dims[:-1], info.qtype, info.offset + expert * per, per)

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info(name).shape

    def dtype(self, name: str) -> torch.dtype:
        """What get() returns: always float32 (dequantized)."""
        self._info(name)
        return torch.float32

    def quant_type(self, name: str) -> str:
        """The GGUF storage type of an HF-named tensor, e.g. 'Q4_K'."""
        return _type_name(self._info(name).qtype)

    def _info(self, name: str) -> TensorInfo | JoinedKV:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing")
        return self._where[name]

    def get(self, name: str) -> torch.Tensor:
        """One tensor under its HF name, dequantized to float32, (Q/K of Llama/Mistral) un-permuted and (Gemma's
        RMSNorm weights) without the 1 llama.cpp added."""
        info = self._info(name)
        if isinstance(info, JoinedKV):
            return join_kv_b(self._dequantize(info.k), self._dequantize(info.v))
        w = self._dequantize(info)
        table = ARCHS[self.arch]
        if table.norm_shift and name.endswith("norm.weight"):
            w = w - table.norm_shift
        if table.permuted_qk and re.search(r"\.self_attn\.[qk]_proj\.(weight|bias)$", name):
            cfg = self.config()
            heads = cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]
            w = unpermute_qk(w, heads)
        return w

    def _dequantize(self, info: TensorInfo) -> torch.Tensor:
        """float32 [shape] from the mapped bytes, CHUNK_ELEMENTS at a time."""
        dequantize = _gguf().quants.dequantize
        qtype = _gguf().GGMLQuantizationType(info.qtype)
        ne0 = info.dims[0]
        rows = math.prod(info.dims[1:])
        data = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(rows, -1)
        out = torch.empty((rows, ne0), dtype=torch.float32)
        view, step = out.numpy(), max(1, CHUNK_ELEMENTS // ne0)
        try:
            for r in range(0, rows, step):
                view[r:r + step] = dequantize(data[r:r + step], qtype).reshape(-1, ne0)
        except NotImplementedError as e:
            raise CheckpointError(f"{self.path}: cannot dequantize {info.name} ({e}); supported: "
                                  f"{', '.join(SUPPORTED_TYPES)}") from None
        return out.reshape(info.shape)

    def fingerprint(self) -> list[list]:
        """[[file name, size, mtime_ns, sha256 of the header]]: changes whenever the file is rewritten."""
        st = self.path.stat()
        end = min(t.offset for t in self._raw.values()) if self._raw else len(self._buf)
        digest = hashlib.sha256(self._buf[:end]).hexdigest()
        return [[self.path.name, st.st_size, st.st_mtime_ns, digest]]

    # -- config

    def _meta(self, key: str, default: Any = ...) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.meta:
            return self.meta[full]
        if default is ...:
            raise CheckpointError(f"{self.path}: GGUF metadata lacks {full!r}, needed for a {self.arch} model")
        return default

    def config(self) -> dict[str, Any]:
        """A config.json-like dict (HF keys) from the metadata; specexec.families.model_args validates it."""
        if self._config is None:
            self._config = self._read_config()
        return dict(self._config)

    def config_names(self) -> dict[str, str]:
        """config.json key -> what names its value in this file ("GGUF metadata minimax-m2.attention.head_count"):
        a bad value's line names the key the file holds, not config.json's."""
        keys = {**METADATA_KEYS, **ARCH_METADATA_KEYS.get(self.arch, {})}
        names = {k: f"GGUF metadata {self.arch}.{v}" for k, v in keys.items()}
        names.update({k: f"GGUF metadata tokenizer.ggml.{v}" for k, v in (
            ("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id"))})
        return {**names, "vocab_size": "token_embd.weight's rows"}

    def _positive(self, key: str, value: Any) -> int:
        """value (metadata `key`'s, one per layer or one for all) as a whole number >= 1, else one line naming
        the key (a head count of 0 divides by zero below)."""
        value = _one_value(value, key, self.path)
        if value < 1:
            raise CheckpointError(f"{self.path}: GGUF metadata {self.arch}.{key} is {value}; it must be at least 1")
        return value

    def _read_config(self) -> dict[str, Any]:
        heads = self._positive("attention.head_count", self._meta("attention.head_count"))
        kv = self._positive("attention.head_count_kv", self._meta("attention.head_count_kv", heads))
        head_dim = self._positive("attention.key_length", head_dim_of(self, heads, int(kv)))
        rope_dim = int(self._meta("rope.dimension_count", head_dim))
        if rope_dim != head_dim and not ARCHS[self.arch].partial_rotary:
            raise CheckpointError(f"{self.path}: partial rotary embedding ({rope_dim} of {head_dim} dims) is not "
                                  "supported; supported: rope over the whole head")
        theta = float(self._meta("rope.freq_base", 10000.0))
        cfg = {
            "architectures": [ARCHS[self.arch].hf_architecture(self.n_experts)], "model_type": self.arch,
            "vocab_size": self.shape("model.embed_tokens.weight")[0],
            "hidden_size": int(self._meta("embedding_length")), "num_hidden_layers": int(self._meta("block_count")),
            "intermediate_size": int(self._meta("feed_forward_length")),
            "num_attention_heads": heads, "num_key_value_heads": int(kv), "head_dim": head_dim,
            "rms_norm_eps": float(self._meta("attention.layer_norm_rms_epsilon")), "rope_theta": theta,
            "max_position_embeddings": int(self._meta("context_length", 4096)),
            "tie_word_embeddings": "lm_head.weight" not in self._where,
            "attention_bias": "model.layers.0.self_attn.o_proj.bias" in self._where,
            "use_sliding_window": False, "sliding_window": None,
            "rope_scaling": self._rope_scaling(head_dim, theta),
        }
        cfg.update(arch_config(self, cfg))
        for key, meta_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                              ("pad_token_id", "padding_token_id")):
            if f"tokenizer.ggml.{meta_key}" in self.meta:
                cfg[key] = int(self.meta[f"tokenizer.ggml.{meta_key}"])
        return cfg

    def factors(self, name: str) -> list[float]:
        """A small F32 tensor of the file (rope factors) as a list."""
        return self._dequantize(self._raw[name]).reshape(-1).tolist()

    def _rope_scaling(self, head_dim: int, theta: float) -> dict[str, Any] | None:
        kind = self._meta("rope.scaling.type", None)
        if kind not in (None, "none"):
            scaling = {"rope_type": kind, "factor": float(self._meta("rope.scaling.factor", 1.0))}
            if "rope_freqs.weight" in self._raw:
                raise CheckpointError(f"{self.path}: both rope.scaling.type {kind!r} and a rope_freqs tensor")
            return scaling
        if "rope_freqs.weight" not in self._raw:
            return None
        factors = self._dequantize(self._raw["rope_freqs.weight"]).double().numpy().reshape(-1)
        if factors.shape[0] != head_dim // 2:
            raise CheckpointError(f"{self.path}: rope_freqs has {factors.shape[0]} factors, head_dim {head_dim} "
                                  f"needs {head_dim // 2}")
        original = self._meta("rope.scaling.original_context_length", None)
        return llama3_rope_scaling(factors, head_dim, theta, original, self.path)


_OPEN: dict[tuple, GGUFCheckpoint] = {}


def open_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """GGUFCheckpoint(path), parsed once per process while the file is unchanged (config, weights and the
    tokenizer each open it; the header of a 150k-token vocabulary takes about a second)."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key not in _OPEN:
        _OPEN.clear()                                   # keep one file mapped at a time
        _OPEN[key] = GGUFCheckpoint(p)
    return _OPEN[key]


def _one_value(value: Any, what: str, path: Path) -> int:
    """A per-layer metadata array with one distinct value -> that value (else unsupported); a whole number."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise CheckpointError(f"{path}: per-layer {what} {sorted(set(value))} is not supported; supported: "
                                  "the same value in every layer")
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value % 1:
        raise CheckpointError(f"{path}: GGUF metadata {what} is {value!r}; it must be a whole number")
    return int(value)


# ----------------------------------------------------------------------------------------- llama3 rope

def _llama3_factors(wavelen: np.ndarray, factor: float, low: float, high: float, orig: float) -> np.ndarray:
    """llama.cpp's rope_freqs for HF's llama3 rope_scaling (convert_hf_to_gguf.py, LlamaModel)."""
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def _fit_llama3(factors: np.ndarray, wavelen: np.ndarray, factor: float) -> tuple[float, float, float] | None:
    """(low 1, high, original context) from the smoothly scaled frequencies, when at least two exist.
    Only orig/low and orig/high matter, so low = 1 loses nothing."""
    mid = (factors > 1 + 1e-6) & (factors < factor - 1e-6)
    if mid.sum() < 2 or factor <= 1:
        return None
    smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelen[mid], smooth, 1)      # smooth = orig/(high-low)/w - low/(high-low)
    if intercept >= 0 or slope <= 0:
        return None
    high, orig = 1 - 1 / intercept, -slope / intercept
    return 1.0, float(round(high, 6)), float(round(orig) if abs(orig - round(orig)) < 1e-3 * orig else orig)


def llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float, original: Any, path: Path) -> dict[str, Any]:
    """HF's llama3 rope_scaling dict that reproduces a GGUF rope_freqs tensor, or CheckpointError."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    factor = float(factors.max())
    candidates = [(1.0, 4.0, float(original))] if original else []
    candidates += [(1.0, 4.0, 8192.0)]
    fitted = _fit_llama3(factors, wavelen, factor)
    candidates += [fitted] if fitted else []
    for low, high, orig in candidates:
        if np.allclose(_llama3_factors(wavelen, factor, low, high, orig), factors, rtol=1e-4, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": int(orig) if orig == int(orig) else orig}
    raise CheckpointError(f"{path}: the rope_freqs tensor matches no Llama-3 rope scaling; supported: rope "
                          "scaling none, linear, or llama3 (factor, low/high_freq_factor, original context)")
