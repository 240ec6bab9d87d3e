"""Local HF checkpoint directory (or a Hub id / models.yaml name: cached, or downloaded through
specexec.checkpoints.hub), AWQ/GPTQ directory or .gguf file -> resident Transformer.

The model is built on the meta device and filled tensor by tensor from safetensors (assign=True), so the
weights exist once in memory, cast to the run dtype. Names, shapes and the tensor set are checked against the
config before anything is used. Pickle checkpoints are refused unless the caller allows them, and even then
are read with torch.load(weights_only=True). Weights come through offload.formats.sources, which picks the reader: plain
safetensors, AWQ/GPTQ (by config.json's quantization_config; dequantized to float32 tensor by tensor) or GGUF
(dequantized likewise; its ModelArgs come from the file's metadata instead of a config.json).

Does not know: offloading (the offload runtime builds on the same checkpoint reader), tokens, trees.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import torch

from offload.formats.checkpoint import CheckpointError, pickle_files
from offload.formats.json_files import read_json
from offload.formats.refs import TensorRef, aligned, read_ref, ref_shape
from offload.formats.sources import CheckpointSource, is_gguf, open_source, tensor_specs

from specexec.config import ModelArgs
from specexec.families import model_args
from specexec.checkpoints.weight_map import checkpoint_refs, unused_tensors
from specexec.options import DTYPES as DTYPE_NAMES, ConfigError
from specexec.checkpoints.hub import HubOptions
from specexec.network.model import Transformer, on_meta

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES if name != "auto"}   # options names the choices


def resolve_model_path(spec: str, hub: HubOptions | None = None) -> Path:
    """A local directory or .gguf file as given (a path always wins; a directory without config.json that holds
    one .gguf file means that file), else a models.yaml name or a Hub id `org/name`: found on this machine
    (huggingface_hub's cache, $SPECEXEC_MODEL_DIRS for models.yaml names) or, with `hub` given and downloads
    on, downloaded into that cache (specexec.checkpoints.hub: config, tokenizer and safetensors only,
    resumable). Without `hub` nothing goes online."""
    path = Path(spec).expanduser()
    if path.is_symlink() and not path.exists():           # else "does not exist" would puzzle whoever sees it
        raise ConfigError(f"{spec} is a symlink that leads nowhere (dangling, or a loop); pass the checkpoint itself")
    if path.is_dir():
        return _gguf_in(path.resolve()) or path.resolve()
    if path.exists():
        if is_gguf(path):
            return path.resolve()
        raise ConfigError(f"{spec} is a file; pass the checkpoint directory (with config.json) or a .gguf file instead")
    from specexec.checkpoints import hub as hub_mod
    from specexec.checkpoints.catalog import DIRS_ENV, find
    entry = find(spec)
    if entry is not None:
        local = entry.local_path() if hub is None or not hub.gguf_file else None
        if local is not None:
            return local
        if entry.local:                                   # only ever on this machine: nothing to download
            made = " (`specexec demo` builds it)" if entry.name.startswith("demo") else ""
            raise ConfigError(f"model {spec!r} is not on this machine yet: {entry.local} has no config.json{made}")
        repo = entry.hub
    elif HUB_ID.match(spec) and not spec.startswith((".", "/")):
        repo = spec
    else:
        from specexec.checkpoints.catalog import closest
        meant = closest(spec)
        if meant:
            raise ConfigError(f"model path {spec} does not exist; did you mean {meant} (`specexec models` lists it)?")
        raise ConfigError(f"model path {spec} does not exist; pass a local checkpoint directory, a Hub id like "
                          "org/name, or a name that `specexec models` lists")
    opts = hub or hub_mod.HubOptions(offline=True)
    found = hub_mod.cached(repo, opts)
    if found is not None:
        return found
    if opts.is_offline():
        why = ("this call only looks in the cache; the specexec commands download" if hub is None else
               "--offline" if hub.offline else "HF_HUB_OFFLINE=1")
        elsewhere = f" nor under ${DIRS_ENV}: {os.environ.get(DIRS_ENV) or 'unset'}" if entry is not None else ""
        prefix = f"model {spec!r} is not on this machine: " if entry is not None else ""
        raise ConfigError(prefix + str(hub_mod.not_cached_error(repo, opts, why, elsewhere)))
    return hub_mod.fetch(repo, opts)


def _gguf_in(directory: Path) -> Path | None:
    """The one .gguf file of a directory without config.json (None when it has config.json or no .gguf)."""
    if (directory / "config.json").exists():
        return None
    found = sorted(directory.glob("*.gguf"))
    if len(found) > 1:
        raise ConfigError(f"{directory} holds {len(found)} .gguf files ({', '.join(f.name for f in found[:3])}"
                          f"{', ...' if len(found) > 3 else ''}); pass one of them as --model")
    return found[0] if found else None


def check_model_path(spec: str) -> Path:
    """The checkpoint `spec` names on this machine (resolve_model_path, offline), checked to be one: a .gguf file
    or a directory with config.json; else one ConfigError naming the path. The commands call it before any
    other check, so a mistyped path is reported as such (not as a missing draft)."""
    path = resolve_model_path(spec)
    if not is_gguf(path) and not os.path.lexists(path / "config.json"):    # a broken link: the reader says why
        raise ConfigError(f"{path} has no config.json; is it a Hugging Face checkpoint directory?")
    return path


def read_args(path: Path) -> ModelArgs:
    """ModelArgs from path/config.json (or a .gguf file's metadata) with one-line errors for a missing or
    unreadable file."""
    if is_gguf(path):
        from offload.formats.gguf import open_gguf
        gguf = open_gguf(path)
        return model_args(gguf.config(), str(path), gguf.config_names())
    cfg_file = path / "config.json"
    if cfg_file.is_symlink() and not cfg_file.exists():
        raise ConfigError(f"{cfg_file} is a symlink that leads nowhere (dangling, or a loop)")
    if not cfg_file.is_file():
        raise ConfigError(f"{path} has no config.json; is it a Hugging Face checkpoint directory?")
    cfg = read_json(cfg_file, str(cfg_file), ConfigError)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_file} must hold a JSON object")
    return model_args(cfg)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on CUDA and float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the Transformer for `args` (built on meta, nothing allocated; once per args:
    an MoE model of 128 experts x 94 layers is 36k modules, seconds to build)."""
    return dict(_shapes(args))


@functools.cache
def _shapes(args: ModelArgs) -> tuple[tuple[str, tuple[int, ...]], ...]:
    with on_meta():
        model = Transformer(args)
    return tuple((name, tuple(p.shape)) for name, p in model.state_dict().items())


def check_tensors(path: Path, source: CheckpointSource | _PickleSource, args: ModelArgs) -> dict[str, TensorRef]:
    """Every model tensor's source in the checkpoint (our name -> TensorRef, by the family's weight-name
    mapping: specexec/checkpoints/weight_map.py), after CheckpointError unless `source` holds exactly the tensors
    `args` implies: no unexpected name (an extra tensor means the checkpoint is not the model config.json
    describes; the tensors the family deliberately leaves unread, such as a multimodal checkpoint's vision tower,
    are not), the right shapes (of each expert's piece of a fused tensor too), floating-point dtypes, nothing
    missing. Headers only, nothing read: the resident loader, the offload planner and `convert` all
    call it before they load, plan or cache anything. Messages name the checkpoint's own tensor."""
    specs = tensor_specs(source)
    _check_layer_count(path, specs, args)            # before the meta model of args is built
    expected = expected_shapes(args)
    refs = checkpoint_refs(args, expected, specs)
    known = {r.name for r in refs.values()} | unused_tensors(args, specs)
    for raw in specs:
        if raw not in known:
            raise CheckpointError(f"{path}: unexpected tensor {raw!r} for a {args.family} model of this config")
    missing = []
    for name, ref in refs.items():
        if ref.name not in specs:
            missing.append(ref.name)
            continue
        dtype, stored = specs[ref.name]
        try:
            shape = ref_shape(ref, stored)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        if shape != expected[name]:
            raise CheckpointError(f"{path}: {ref.describe()} has shape {list(shape)}, config.json implies "
                                  f"{list(expected[name])}")
        if not dtype.is_floating_point:
            raise CheckpointError(f"{path}: {ref.name} has dtype {dtype}; expected floating-point weights")
    if missing:
        missing = sorted(set(missing))
        raise CheckpointError(f"{path}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    return refs


LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|blk|h)\.(\d+)\.")


def _check_layer_count(path: Path, specs: dict, args: ModelArgs) -> None:
    """CheckpointError when config.json names more decoder layers than the checkpoint's tensors hold (its MTP
    layers stored after them count), said before a model of that size is built even on meta."""
    found = [int(m.group(1)) for name in specs if (m := LAYER_INDEX.search(name))]
    if found and max(found) + 1 < args.n_layers:
        raise CheckpointError(f"{path}: config.json says {args.n_layers} decoder layers; the checkpoint's tensors "
                              f"hold {max(found) + 1}")


def check_checkpoint(path: Path, args: ModelArgs, allow_pickle: bool = False) -> None:
    """check_tensors on the weights load_model would read (headers only for safetensors/GGUF), so a broken
    checkpoint is refused before anything is planned or loaded."""
    check_tensors(path, _open_weights(path, allow_pickle), args)


def read_state(path: Path, args: ModelArgs, dtype: torch.dtype, device: torch.device,
               allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """Checked tensors (check_tensors) by model parameter name, cast to dtype on device, one tensor at a time,
    each in 64-byte-aligned memory of its own (refs.aligned: as a streamed layer's, so both compute alike)."""
    source = _open_weights(path, allow_pickle)
    refs = check_tensors(path, source, args)
    return {name: aligned(read_ref(source, ref).to(device=device, dtype=dtype)) for name, ref in refs.items()}


def load_model(path: Path, device: str | torch.device = "cpu", dtype: str = "auto",
               allow_pickle: bool = False) -> Transformer:
    """A resident Transformer in eval mode with every weight from the checkpoint at `path`."""
    device = torch.device(device)
    args = read_args(path)
    state = read_state(path, args, resolve_dtype(dtype, device), device, allow_pickle)
    with on_meta():
        model = Transformer(args)
    model.load_state_dict(state, strict=True, assign=True)
    model.init_rope(device)
    return model.eval().requires_grad_(False)


class _PickleSource:
    """Pickle weights read with torch.load(weights_only=True): only when the user asked for it."""

    def __init__(self, files: list[Path]) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                self.tensors.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
            except Exception as e:
                raise CheckpointError(f"{f}: cannot read it as plain tensors ({_first_reason(e)})") from None
        odd = next((k for k, v in self.tensors.items() if not isinstance(v, torch.Tensor)), None)
        if odd is not None:                      # e.g. a training checkpoint: {"model": {...}, "step": 3}
            raise CheckpointError(f"{files[0].parent}: pickle entry {odd!r} is not a tensor; expected a flat "
                                  "name -> tensor state dict")

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _first_reason(e: Exception) -> str:
    """The telling part of torch.load's long weights_only refusal ("Unsupported global: ..."), else its first line."""
    text = str(e)
    start = text.find("Unsupported global")
    return (text[start:].split(". ")[0] if start >= 0 else text.strip().splitlines()[0] if text.strip() else
            type(e).__name__)


def open_weights(path: Path, allow_pickle: bool = False) -> CheckpointSource | _PickleSource:
    """The tensors of the checkpoint at `path` by their stored names (headers only until read): safetensors,
    GGUF, AWQ/GPTQ, or pickle files when allow_pickle (CheckpointError otherwise)."""
    return _open_weights(path, allow_pickle)


def _open_weights(path: Path, allow_pickle: bool) -> CheckpointSource | _PickleSource:
    if is_gguf(path):
        return open_source(path)
    has_safetensors = any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists()
    pickles = pickle_files(path)
    if not has_safetensors and pickles:
        if not allow_pickle:
            raise CheckpointError(f"{path} holds pickle weights ({pickles[0].name}), which can run code when "
                                  "loaded; convert them to safetensors, or pass --allow-pickle to read them "
                                  "with torch.load(weights_only=True)")
        return _PickleSource(pickles)
    return open_source(path)                    # safetensors, or AWQ/GPTQ by config.json's quantization_config
