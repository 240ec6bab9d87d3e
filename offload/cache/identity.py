"""What a layer cache was built from: the checkpoint's fingerprint, the build options, and the directory name.

`fingerprint` is cheap (names, sizes, mtimes and header hashes of the checkpoint's files: no tensor data is read);
`options_of` is everything else that decides the cache's bytes; `cache_dir_for` names the directory after both,
under `default_cache_root()` (cpu_kernels/cache_root.py). `source_specs` gives every checkpoint tensor's dtype and
shape from the headers alone (for planning layer sizes before anything is quantized).

Does not know: the manifest's checks (cache_manifest.py), reading or building layers (cache_reading.py,
cache.py).
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath

import torch

from offload.cache.manifest import VERSION, CacheError
from offload.formats.checkpoint import INDEX, SINGLE, ST_DTYPES, read_header, shard_path
from offload.formats.json_files import weight_map
from offload.formats.refs import TensorRef, as_ref
from offload.formats.sources import detect_format, is_gguf, open_source, tensor_specs
from offload.quant.weights import dtype_name, packing


@dataclass(frozen=True)
class LayerNames:
    """Where one layer's tensors come from: packed name (as the runtime binds it, e.g. 'mlp.up_proj.weight')
    -> checkpoint tensor name ('model.layers.3.mlp.up_proj.weight') or a TensorRef (a piece of a stored
    tensor: one expert of a fused one, offload/formats/refs.py), in packing order; `linear` holds the packed
    names of the 2-D nn.Linear weights to quantize (every other tensor is cast to the dtype); `regions`: packed
    name prefixes, each one a separately aligned sub-region of the packed layer (offload/streaming/storage.py;
    e.g. one expert each), so it can be read or copied alone (empty: the layer is one region)."""
    tensors: Mapping[str, str | TensorRef]
    linear: frozenset[str]
    regions: tuple[str, ...] = ()

    def refs(self) -> dict[str, TensorRef]:
        """packed name -> TensorRef (a bare name as the whole stored tensor)."""
        return {p: as_ref(c) for p, c in self.tensors.items()}

    def to_dict(self) -> dict:
        out = {"tensors": {p: r.to_json() for p, r in self.refs().items()}, "linear": sorted(self.linear)}
        if self.regions:                     # absent without regions: a dense layer's naming hashes as before
            out["regions"] = list(self.regions)
        return out


def _header(path: Path) -> tuple[bytes, dict]:
    """(raw header bytes, parsed header) of a safetensors file."""
    return read_header(path, CacheError)


def _weight_files(checkpoint_dir: Path) -> list[Path]:
    index = checkpoint_dir / INDEX
    if index.is_file():
        names = sorted(set(weight_map(index, CacheError).values()))
        return [shard_path(checkpoint_dir, n, index) for n in names]
    return [checkpoint_dir / SINGLE]


SAMPLES, SAMPLE_BYTES = 64, 4096       # blocks of a weight file's bytes hashed into its fingerprint


def sampled_digest(path: Path) -> str:
    """sha256 of SAMPLES blocks of SAMPLE_BYTES spread evenly over the file (its first and last included): the
    weights themselves, cheaply. A file whose weights were swapped keeps its size and can keep its mtime (touch
    -r, a copy with preserved times); its sampled bytes do not stay the same."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        last = max(size - SAMPLE_BYTES, 0)
        for k in range(SAMPLES):
            f.seek(last * k // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def fingerprint(checkpoint_dir: str | os.PathLike) -> list[list]:
    """[[file name, size, mtime_ns, sha256 of its header or whole text(, sampled_digest of a weight file)]] for
    config.json, the safetensors index and every weight file: changes whenever the checkpoint is rewritten,
    its weights included (sampled), and costs a few header reads and SAMPLES small reads per weight file. A .gguf
    file: its own name, size, mtime, header hash and sampled digest."""
    d = Path(checkpoint_dir)
    if is_gguf(d):
        return [entry + [sampled_digest(d)] for entry in open_source(d).fingerprint()]
    out = []
    for p in [d / "config.json", d / INDEX] + _weight_files(d):
        if not p.is_file():
            continue
        st = p.stat()
        weights = p.suffix == ".safetensors"
        head = _header(p)[0] if weights else p.read_bytes()
        out.append([p.name, st.st_size, st.st_mtime_ns, hashlib.sha256(head).hexdigest()]
                   + ([sampled_digest(p)] if weights else []))
    return out


def source_specs(checkpoint_dir: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Checkpoint tensor name -> (dtype, shape), from the safetensors headers alone (GGUF, AWQ, GPTQ: the
    dense tensors their source returns, offload.formats.sources)."""
    if detect_format(checkpoint_dir) != "safetensors":
        return tensor_specs(open_source(checkpoint_dir))
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for f in _weight_files(checkpoint_dir):
        for name, info in _header(f)[1].items():
            if name != "__metadata__":
                if info["dtype"] not in ST_DTYPES:
                    raise CacheError(f"{f}: tensor {name} has dtype {info['dtype']}, which the cache cannot pack")
                specs[name] = (ST_DTYPES[info["dtype"]], tuple(info["shape"]))
    return specs


def options_of(checkpoint_dir: Path, layers: Sequence[LayerNames], fmt: str, dtype: torch.dtype,
               double_quant: bool, device: str | torch.device | None = None) -> dict:
    """Everything that decides the cache's bytes besides the source files (stored in the manifest). `device`:
    where the layers are quantized; int4 packs for that device's kernel (quant.packing), int8 names its scheme."""
    dq = bool(double_quant and fmt in ("nf4", "fp4"))
    options = {"version": VERSION, "checkpoint": str(checkpoint_dir), "source_format": detect_format(checkpoint_dir),
               "format": fmt, "dtype": dtype_name(dtype), "double_quant": dq, "sources": [s.to_dict() for s in layers]}
    layout = packing(fmt, device or "cpu")
    return options if layout is None else {**options, "packing": layout}


NAME_CHARS = 64                    # of the checkpoint's name in a cache directory's name (Windows: 260-char paths)


def cache_dir_for(checkpoint_dir: PurePath, options: dict, cache_root: Path) -> Path:
    """<root>/<checkpoint name>-<fmt>-<dtype>[-dq]-<16 hex of the options' hash>. The name part keeps letters,
    digits and "._-" (anything else, e.g. the spaces, colons and backslashes of a Windows path, becomes "_"),
    never starts with a dot and has at most NAME_CHARS characters: a valid file name on every platform."""
    key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in checkpoint_dir.name)
    name = name.lstrip(".")[:NAME_CHARS] or "model"
    dq = "-dq" if options["double_quant"] else ""
    return cache_root / f"{name}-{options['format']}-{options['dtype']}{dq}-{key}"
