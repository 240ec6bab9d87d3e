"""Checkpoints by Hugging Face Hub name: list a repo, pick the files this runtime loads, download them into
huggingface_hub's cache (resuming an interrupted file from the bytes already on disk), and find them there
offline.

What is fetched: config.json, generation_config.json, the tokenizer files, and the safetensors weights (the
shards the index names, or the one model.safetensors), all from the repo's top level. Never pickles (*.bin,
*.pt, *.pth) and nothing else; a GGUF repo gives exactly the .gguf file named by `HubOptions.gguf_file`.

The cache layout is huggingface_hub's own (blobs/<etag>, snapshots/<commit>/<file> links, refs/<revision>), so
transformers, vLLM or SGLang reuse what was fetched here and a `huggingface-cli download` is found here. A file
streams into blobs/<etag>.part through huggingface_hub's `http_get` (which reconnects with a Range request when a
connection drops mid-file); when the process itself stops (Ctrl-C, a crash, a reboot), the next run continues
from the .part file's length. Every byte is checked against the etag (sha256 for LFS files, the git blob id
otherwise) before the file is published, so a resume that joined mismatched halves cannot go unnoticed.

Errors are one-line ConfigErrors: access denied (401/403, gated or private: set HF_TOKEN), no such repo (404),
offline (HF_HUB_OFFLINE=1 or HubOptions.offline) with the files not cached, no connection, not enough disk, and
an architecture this runtime does not run (checked on the fetched config.json before any weight is fetched).

Does not know: the terminal (progress goes to a callback), planning (the caller's `reserve` says how much more
disk the run needs once config.json is here), how a checkpoint loads (specexec.checkpoints.loading).
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from offload.formats.json_files import read_json, weight_map
from offload.memory_plan import gb_text
from specexec.options import ConfigError
from specexec.checkpoints.hub_files import COMMIT, PART, Progress, Ticker, download, link_blob, write_ref

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
DISK_MARGIN = 256 << 20                 # bytes left free beyond what the download and the layer cache need

Reserve = Callable[[Path], Sequence[tuple[Path, int]]]        # snapshot dir -> [(directory, bytes it will need)]


@dataclass(frozen=True)
class HubOptions:
    """How to reach the Hub. endpoint: default $HF_ENDPOINT or huggingface.co; cache_dir: default
    huggingface_hub's cache ($HF_HUB_CACHE, $HF_HOME/hub); offline also when HF_HUB_OFFLINE=1. model: the repo
    is a model whose architecture must be one this runtime runs (False: a drafter's head, checked by its own
    loader)."""

    offline: bool = False
    gguf_file: str | None = None
    revision: str = "main"
    progress: Progress | None = None
    reserve: Reserve | None = None
    endpoint: str | None = None
    cache_dir: Path | None = None
    model: bool = True

    def is_offline(self) -> bool:
        from huggingface_hub import constants
        env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        return self.offline or env or bool(constants.HF_HUB_OFFLINE)

    def base_url(self) -> str:
        from huggingface_hub import constants
        return (self.endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")

    def hub_cache(self) -> Path:
        from huggingface_hub import constants
        if self.cache_dir is not None:
            return Path(self.cache_dir)
        if os.environ.get("HF_HUB_CACHE"):
            return Path(os.environ["HF_HUB_CACHE"]).expanduser()
        if os.environ.get("HF_HOME"):
            return Path(os.environ["HF_HOME"]).expanduser() / "hub"
        return Path(constants.HF_HUB_CACHE)


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int


@dataclass(frozen=True)
class Listing:
    """A repo at one commit: its files with their sizes."""

    repo: str
    commit: str
    files: tuple[RemoteFile, ...]

    def get(self, name: str) -> RemoteFile | None:
        return next((f for f in self.files if f.name == name), None)


# ----------------------------------------------------------------------------------------- the local cache

def storage_dir(repo: str, opts: HubOptions) -> Path:
    """huggingface_hub's folder for a model repo: <cache>/models--ORG--NAME."""
    return opts.hub_cache() / ("models--" + repo.replace("/", "--"))


def cached(repo: str, opts: HubOptions) -> Path | None:
    """The complete cached checkpoint of `repo` at opts.revision (the snapshot directory, or the .gguf file in
    it), else None. Looked up on disk only."""
    snapshot = _snapshot_of(repo, opts)
    if snapshot is None or missing(snapshot, opts.gguf_file):
        return None
    return snapshot / opts.gguf_file if opts.gguf_file else snapshot


def _snapshot_of(repo: str, opts: HubOptions) -> Path | None:
    storage = storage_dir(repo, opts)
    commit = opts.revision if COMMIT.match(opts.revision) else None
    ref = storage / "refs" / opts.revision
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
    snapshot = storage / "snapshots" / commit if commit else None
    return snapshot if snapshot is not None and snapshot.is_dir() else None


def missing(snapshot: Path, gguf_file: str | None = None) -> list[str]:
    """What the snapshot lacks to be loadable: the .gguf file; or config.json and the weights (every shard its
    index names, else some *.safetensors or *.bin file). Empty when complete."""
    if gguf_file:
        return [] if (snapshot / gguf_file).is_file() else [gguf_file]
    if not (snapshot / "config.json").is_file():
        return ["config.json"]
    for index in (INDEX, "pytorch_model.bin.index.json"):
        if (snapshot / index).is_file():
            return [s for s in _shards(snapshot / index) if not (snapshot / s).is_file()]
    if any(snapshot.glob("*.safetensors")) or any(snapshot.glob("*.bin")):
        return []
    return ["*.safetensors"]


def _shards(index: Path) -> list[str]:
    try:
        return sorted(set(weight_map(index, ConfigError).values()))
    except OSError:
        raise ConfigError(f"{index} is not a valid weight index (JSON with a weight_map)") from None


def not_cached_error(repo: str, opts: HubOptions, why: str, elsewhere: str = "") -> ConfigError:
    """The one line for a name that is not (completely) in the cache while downloads are off; `elsewhere`
    names other places that were searched."""
    snapshot = _snapshot_of(repo, opts)
    lacks = missing(snapshot, opts.gguf_file) if snapshot is not None else []
    where = (f"is incomplete in the local Hugging Face cache ({snapshot} lacks {lacks[0]}"
             f"{', ...' if len(lacks) > 1 else ''})" if lacks else
             f"is not in the local Hugging Face cache ({opts.hub_cache()}{elsewhere})")
    return ConfigError(f"{repo} {where} and downloads are off ({why}); run once without that to download it (an "
                       f"interrupted download resumes), or pass its directory, e.g. --model /path/to/"
                       f"{repo.split('/')[-1]}")


# ----------------------------------------------------------------------------------------- listing + choice

def list_repo(repo: str, opts: HubOptions) -> Listing:
    """The repo's files and sizes at opts.revision (one API call)."""
    from huggingface_hub import HfApi
    try:
        info = HfApi(endpoint=opts.base_url()).model_info(repo, revision=opts.revision, files_metadata=True)
    except Exception as e:                              # noqa: BLE001 -- every failure becomes one line
        raise hub_error(e, repo, opts) from None
    files = tuple(RemoteFile(s.rfilename, int(s.size or 0)) for s in info.siblings or ())
    if not info.sha:
        raise ConfigError(f"{opts.base_url()} gave no commit for {repo}@{opts.revision}")
    return Listing(repo, info.sha, files)


def first_files(listing: Listing, gguf_file: str | None) -> list[RemoteFile]:
    """The small files fetched before the weights (config, tokenizer, index); ConfigError when the repo holds
    nothing this runtime loads."""
    top = {f.name: f for f in listing.files if "/" not in f.name}
    ggufs = sorted(f.name for f in listing.files if f.name.endswith(".gguf"))
    if gguf_file:
        if listing.get(gguf_file) is None:
            raise ConfigError(f"{listing.repo} has no file {gguf_file!r}; its .gguf files: {_few(ggufs) or 'none'}")
        return []
    if not any(n.endswith(".safetensors") for n in top):
        if ggufs:
            raise ConfigError(f"{listing.repo} holds GGUF files; pick one with --gguf-file NAME ({_few(ggufs)})")
        pickles = sorted(n for n in top if n.endswith(PICKLES))
        extra = f" (only pickle weights such as {pickles[0]}, which are never downloaded)" if pickles else ""
        raise ConfigError(f"{listing.repo} has no safetensors weights at its top level{extra}; pass a repo with "
                          "*.safetensors, a GGUF file (--gguf-file), or a local checkpoint directory")
    if "config.json" not in top:
        raise ConfigError(f"{listing.repo} has no config.json at its top level; it is not a checkpoint this "
                          "runtime loads")
    return [top[n] for n in (*CONFIG_FILES, *TOKENIZER_FILES, INDEX) if n in top]


def weight_files(listing: Listing, snapshot: Path, gguf_file: str | None) -> list[RemoteFile]:
    """The weights: the .gguf file; the shards the (already fetched) index names; else model.safetensors; else
    every top-level *.safetensors."""
    if gguf_file:
        return [listing.get(gguf_file)]
    if (snapshot / INDEX).is_file():
        names = _shards(snapshot / INDEX)
        absent = [n for n in names if listing.get(n) is None]
        if absent:
            raise ConfigError(f"{listing.repo}: {INDEX} names {absent[0]!r}, which the repo does not hold")
        return [listing.get(n) for n in names]
    if listing.get(SINGLE) is not None:
        return [listing.get(SINGLE)]
    return [f for f in listing.files if "/" not in f.name and f.name.endswith(".safetensors")]


def _few(names: Sequence[str], n: int = 4) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


# ----------------------------------------------------------------------------------------- download

def fetch(repo: str, opts: HubOptions) -> Path:
    """Download what `repo` needs (skipping what is cached) and return the snapshot directory, or the .gguf
    file in it. Checks free disk (weights still to come plus opts.reserve) before the weights start."""
    listing = list_repo(repo, opts)
    storage = storage_dir(repo, opts)
    snapshot = storage / "snapshots" / listing.commit
    write_ref(storage, opts.revision, listing.commit)          # first, so an unfinished snapshot is found offline
    ticker = Ticker(opts.progress)
    first = first_files(listing, opts.gguf_file)
    ticker.total = sum(f.size for f in first)
    for f in first:
        fetch_file(listing, f, storage, opts, ticker)
    if not opts.gguf_file and opts.model:
        check_architecture(snapshot / "config.json")
    weights = weight_files(listing, snapshot, opts.gguf_file)
    ticker.total += sum(f.size for f in weights)
    ticker.file = "checking free disk"
    ticker.advance(0)
    check_disk(_still_to_fetch(weights, snapshot, storage), storage, snapshot, opts)
    for f in weights:
        fetch_file(listing, f, storage, opts, ticker)
    return snapshot / opts.gguf_file if opts.gguf_file else snapshot


def check_architecture(config: Path) -> None:
    """ConfigError (specexec.families' one line: which architecture, that it is not supported, and why for a
    hybrid) when the fetched config.json is not a model this runtime runs: before a byte of weights moves."""
    from specexec.families import model_args

    cfg = read_json(config, str(config), ConfigError)
    if not isinstance(cfg, dict):
        raise ConfigError(f"{config} must hold a JSON object")
    model_args(cfg)


def _still_to_fetch(files: Sequence[RemoteFile], snapshot: Path, storage: Path) -> int:
    """Bytes not yet on disk: files without a snapshot link, less what their .part files hold."""
    parts = {p.name: p.stat().st_size for p in (storage / "blobs").glob("*" + PART)} \
        if (storage / "blobs").is_dir() else {}
    todo = sum(f.size for f in files if not (snapshot / f.name).exists())
    return max(todo - sum(parts.values()), 0)


def check_disk(weights: int, storage: Path, snapshot: Path, opts: HubOptions) -> None:
    """ConfigError naming the need and what is free when a file system cannot hold its share: the weights
    still to fetch (the Hub cache) plus whatever opts.reserve asks (e.g. the layer cache the plan builds)."""
    wants: list[tuple[Path, int]] = [(storage, weights)]
    if opts.reserve is not None:
        wants += list(opts.reserve(snapshot))
    by_device: dict[int, list] = {}
    for directory, need in wants:
        existing = _existing_parent(directory)
        entry = by_device.setdefault(existing.stat().st_dev, [existing, 0, []])
        entry[1] += need
        entry[2].append(f"{gb_text(need)} in {directory}")
    for existing, need, parts in by_device.values():
        free = disk_free(existing)
        if need + DISK_MARGIN > free:
            raise ConfigError(f"not enough disk space to download {opts.gguf_file or 'the model'}: needs "
                              f"{' + '.join(parts)}, {gb_text(free)} free on that disk; free some space, or point "
                              "HF_HOME (the download) and SPECEXEC_CACHE (the layer cache) at a larger disk")


def disk_free(path: Path) -> int:
    """Free bytes on path's file system (a function so tests can shrink the disk)."""
    return shutil.disk_usage(path).free


def _existing_parent(path: Path) -> Path:
    path = Path(path).expanduser().absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path




def fetch_file(listing: Listing, f: RemoteFile, storage: Path, opts: HubOptions, ticker: Ticker) -> None:
    """One file into blobs/<etag> (resuming its .part), then linked into the commit's snapshot."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    pointer = storage / "snapshots" / listing.commit / f.name
    ticker.file = f.name
    if pointer.exists():
        ticker.advance(f.size)
        return
    url = hf_hub_url(listing.repo, f.name, revision=listing.commit, endpoint=opts.base_url())
    try:
        meta = get_hf_file_metadata(url)
        if not meta.etag:
            raise ConfigError(f"{opts.base_url()} gave no etag for {listing.repo}/{f.name}")
        blob = storage / "blobs" / meta.etag
        if not blob.exists():
            download(meta.location, blob, meta.etag, meta.size, ticker)
        else:
            ticker.advance(f.size)
    except (ConfigError, KeyboardInterrupt):
        raise
    except Exception as e:                              # noqa: BLE001 -- every failure becomes one line
        raise hub_error(e, listing.repo, opts, f.name) from None
    link_blob(blob, pointer)


# ----------------------------------------------------------------------------------------- errors

def hub_error(e: BaseException, repo: str, opts: HubOptions, file: str | None = None) -> ConfigError:
    """One line for a failed Hub request: denied (401/403: HF_TOKEN), missing (404), unreachable."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RemoteEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    base = opts.base_url()
    status = getattr(getattr(e, "response", None), "status_code", None)
    token = "HF_TOKEN is set but its account" if os.environ.get("HF_TOKEN") else "no HF_TOKEN is set, so this machine"
    if isinstance(e, GatedRepoError):
        return ConfigError(f"access to {repo} denied (HTTP {status}): it is gated and {token} has no access; "
                           f"accept its terms at {base}/{repo}, then set HF_TOKEN to a read token of that account")
    if isinstance(e, RevisionNotFoundError):
        return ConfigError(f"{repo} has no revision {opts.revision!r} on {base} (HTTP {status})")
    if isinstance(e, RemoteEntryNotFoundError):
        return ConfigError(f"{repo} has no file {file!r} on {base} (HTTP {status})")
    if isinstance(e, RepositoryNotFoundError) and status != 401:
        return ConfigError(f"no model {repo} on {base} (HTTP {status or 404}); check the name (`specexec models` "
                           "lists known ones) or pass a local checkpoint directory")
    if isinstance(e, RepositoryNotFoundError) or status in (401, 403):
        return ConfigError(f"access to {repo} denied (HTTP {status}): it is private, gated or does not exist, and "
                           f"{token} has no access; set HF_TOKEN to a token with read access to it")
    if isinstance(e, HfHubHTTPError):
        return ConfigError(f"{base} answered HTTP {status} for {repo}{'/' + file if file else ''}; try again later")
    reason = " ".join(str(e).split())[:160] or type(e).__name__
    return ConfigError(f"cannot download {repo}{'/' + file if file else ''} from {base} ({type(e).__name__}: "
                       f"{reason}); check the network, or pass --offline to use only cached models")
