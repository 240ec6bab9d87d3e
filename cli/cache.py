"""`specexec cache ls | du | rm MODEL`: what specexec keeps on disk, and removing a model's layer caches.

The cache root (cpu_kernels/cache_root: $SPECEXEC_CACHE, else $XDG_CACHE_HOME/specexec, else ~/.cache/specexec)
holds one directory per layer cache (`<model>-<format>-<dtype>-<hash>`, a manifest.json beside its layers.bin:
offload/cache/store.py), and the small stores beside them (kernels/, demo/, costs/, acceptance/, vocab/, prefix/,
...). `ls` lists the layer caches (model, format, size, when built, the checkpoint it was built from); `du` sums
every entry of the root; `rm MODEL` removes the layer caches built from MODEL (a directory-name prefix, the
checkpoint's directory name, or its path), each under its build lock so a build in progress is never cut (the
locks live in <root>/.locks, never beside the caches).

Does not know: how a layer cache is built or read (offload/cache/), the Hugging Face cache (`hf cache` owns it).
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from cpu_kernels.cache_root import default_cache_root
from specexec.options import ConfigError

MANIFEST = "manifest.json"            # offload/cache/manifest.MANIFEST (importing it there would import torch)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("cache", help="list, size or remove what specexec keeps on disk (layer caches, kernels, ...)",
                       description="The layer caches and stores under the cache root ($SPECEXEC_CACHE, else "
                                   "$XDG_CACHE_HOME/specexec, else ~/.cache/specexec). The Hugging Face cache "
                                   "(downloaded checkpoints) is huggingface_hub's: `hf cache` lists and removes it.")
    p.add_argument("--cache-dir", metavar="DIR", help="the cache root (default: as above)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("action", choices=("ls", "du", "rm"), metavar="ACTION",
                   help="ls: the layer caches; du: bytes per entry of the root; rm MODEL: remove MODEL's layer caches")
    p.add_argument("model", nargs="?", metavar="MODEL", help="with rm: a layer cache's name or its prefix (a "
                   "model name as `ls` shows it), or the checkpoint directory it was built from")
    return p


def size_of(path: Path) -> int:
    """Bytes of a file or of every file under a directory (links not followed)."""
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def layer_caches(root: Path) -> list[dict]:
    """Every layer cache under root: name, checkpoint, format, dtype, layers, bytes, created."""
    out = []
    for manifest in sorted(root.glob(f"*/{MANIFEST}")):
        try:
            m = json.loads(manifest.read_text())
        except (OSError, ValueError):
            m = {}
        if not isinstance(m, dict):
            m = {}
        d = manifest.parent
        out.append({"name": d.name, "path": str(d), "checkpoint": m.get("checkpoint"), "format": m.get("format"),
                    "dtype": m.get("dtype"), "layers": len(m.get("layers") or ()), "bytes": size_of(d),
                    "created": m.get("created")})
    return out


def matching(root: Path, model: str) -> list[dict]:
    """The layer caches `model` names: a directory name or its prefix (model-format-...), the checkpoint's
    directory name, or the checkpoint's path."""
    want = model.rstrip("/")
    path = str(Path(want).expanduser().resolve()) if Path(want).expanduser().exists() else None
    found = []
    for c in layer_caches(root):
        ckpt = c["checkpoint"] or ""
        if (c["name"] == want or c["name"].startswith(want + "-") or Path(ckpt).name == want
                or (path is not None and ckpt == path)):
            found.append(c)
    return found


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def run(args: argparse.Namespace) -> int:
    root = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache_root()
    if args.action != "rm" and args.model:
        raise ConfigError(f"`specexec cache {args.action}` takes no MODEL (only `cache rm MODEL` does)")
    if args.action == "ls":
        return _ls(root, args.json)
    if args.action == "du":
        return _du(root, args.json)
    if not args.model:
        raise ConfigError("`specexec cache rm` needs the MODEL whose layer caches to remove (`specexec cache ls` "
                          "lists them)")
    return _rm(root, args.model, args.json)


def _ls(root: Path, as_json: bool) -> int:
    caches = layer_caches(root) if root.is_dir() else []
    if as_json:
        print(json.dumps({"root": str(root), "layer_caches": caches}, separators=(",", ":")), flush=True)
        return 0
    if not caches:
        print(f"no layer caches under {root}")
        return 0
    width = max(len(c["name"]) for c in caches)
    for c in caches:
        print(f"{c['name']:<{width}}  {gb(c['bytes']):>10}  {c['layers']:>4} layers  {c['format']}/{c['dtype']}  "
              f"{(c['created'] or '')[:10]}  from {c['checkpoint']}")
    print(f"{len(caches)} layer cache{'s' * (len(caches) != 1)}, {gb(sum(c['bytes'] for c in caches))} under {root} "
          "(`specexec cache rm MODEL` removes one)")
    return 0


def _du(root: Path, as_json: bool) -> int:
    entries = sorted(((p.name, size_of(p)) for p in root.iterdir()), key=lambda e: -e[1]) if root.is_dir() else []
    total = sum(n for _, n in entries)
    if as_json:
        print(json.dumps({"root": str(root), "bytes": total, "entries": dict(entries)}, separators=(",", ":")),
              flush=True)
        return 0
    for name, n in entries:
        print(f"{gb(n):>10}  {name}")
    print(f"{gb(total):>10}  total under {root}")
    return 0


def _rm(root: Path, model: str, as_json: bool) -> int:
    from offload.cache.store import exclusive_lock, lock_path

    found = matching(root, model) if root.is_dir() else []
    if not found:
        names = ", ".join(c["name"] for c in layer_caches(root)) if root.is_dir() else ""
        raise ConfigError(f"no layer cache of {model!r} under {root}" + (f"; there are: {names}" if names else ""))
    freed = 0
    for c in found:
        d = Path(c["path"])
        with exclusive_lock(lock_path(d), timeout=5.0):      # never under a build in progress
            shutil.rmtree(d)
        freed += c["bytes"]
        if not as_json:
            print(f"removed {d} ({gb(c['bytes'])})")
    if as_json:
        print(json.dumps({"removed": [c["path"] for c in found], "bytes": freed}, separators=(",", ":")), flush=True)
    else:
        print(f"freed {gb(freed)}")
    return 0
