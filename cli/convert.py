"""`specexec convert`: quantize a checkpoint's decoder layers into the on-disk layer cache, explicitly.

What `generate --quant ...` would otherwise do on its first offloaded run: read the checkpoint layer by layer,
quantize, pack, and write the cache (offload.cache.store) with a progress bar on stderr; then print where it went and
its size on stdout. `--verify` then reads every layer back and checks its sha256: the full check that runs
skip (they check sizes and the manifest at start, and each layer's checksum when they first read it). --out is
the cache ROOT (as $SPECEXEC_CACHE): the cache lands in a subdirectory named for the checkpoint and options,
the one later runs with the same root find by themselves.

Does not know: how a cache is laid out or validated (offload.cache.store), which tensors a layer has
(specexec.checkpoints.naming.layer_names, the same naming the runtime uses, so both find the same cache).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from typing import TYPE_CHECKING

from cpu_kernels.cache_root import default_cache_root
from offload.memory_plan import gb_text
from offload.quant import FORMATS
from cli.fetch import fetch_model
from specexec.options import DTYPES, check_device, check_integer

if TYPE_CHECKING:                                  # annotations only: the command line parses without torch
    from offload.cache.store import LayerCache


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("convert", help="quantize a checkpoint's layers into the on-disk layer cache",
                       description="Quantize the decoder layers of a checkpoint once and write them, packed, to the "
                                   "layer cache that offloaded runs stream from.")
    p.add_argument("--model", required=True, metavar="PATH", help="checkpoint directory, or a Hub id ORG/NAME "
                   "(downloaded when not cached)")
    p.add_argument("--offline", action="store_true", help="never download (also HF_HUB_OFFLINE=1)")
    p.add_argument("--quant", required=True, choices=FORMATS, help="quantization format of the linear weights")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="dtype the layers compute in (default auto: bf16 for --device cuda, float32 for cpu)")
    p.add_argument("--device", default="cpu", metavar="DEV",
                   help="the device the cache is meant for: decides --dtype auto, and cuda also quantizes on the "
                        "GPU, which is much faster (default cpu)")
    p.add_argument("--double-quant", action="store_true", help="also quantize the NF4/FP4 block scales")
    p.add_argument("--out", metavar="DIR", help="cache root directory (default $SPECEXEC_CACHE, else "
                                                "$XDG_CACHE_HOME/specexec, else ~/.cache/specexec)")
    p.add_argument("--verify", action="store_true",
                   help="then read every layer back and check its sha256 (a full check; runs otherwise check sizes "
                        "and the manifest at start, and each layer's checksum when they first read it)")
    p.add_argument("--quality", action="store_true",
                   help="int4: a slower, finer search for each group's range (21 clipping factors and 4 refits "
                        "instead of 3 and 2); recorded in the cache, which later runs use as they find it")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads that quantize (default: torch's, one per core)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from offload.cache.store import LayerCache
    from specexec.checkpoints.loading import read_args, resolve_dtype, resolve_model_path
    from specexec.checkpoints.naming import layer_names

    check_device(args.device)
    fetch_model(args, "model")
    path = resolve_model_path(args.model)
    model_args = read_args(path)
    dtype = resolve_dtype(args.dtype, torch.device(args.device))
    root = Path(args.out).expanduser() if args.out else default_cache_root()
    if args.threads is not None:
        check_integer("--threads", args.threads, 1, 4096)
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    cache = LayerCache.open_or_build(path, layer_names(path, model_args), args.quant, dtype, cache_root=root,
                                     double_quant=args.double_quant, progress=not args.no_progress,
                                     quantize_device=args.device if args.device.startswith("cuda") else None,
                                     search="quality" if args.quality else None)
    with cache:
        what = "built" if cache.built else "already up to date"
        print(f"{cache.path} ({what}): {cache.n_layers} layers, {args.quant}, {cache.dtype}, "
              f"{gb_text(cache.total_nbytes)} in {time.perf_counter() - t0:.1f} s", flush=True)
        if args.verify:
            verify(cache, progress=not args.no_progress)
    return 0


def verify(cache: LayerCache, progress: bool) -> None:
    """Read every layer and check its sha256 (CacheCorruptError, one line, on the first mismatch: the cache
    is then marked so the next run rebuilds it); print what was checked."""
    t0 = time.perf_counter()
    nbytes = cache.verify_all(progress=progress)
    seconds = time.perf_counter() - t0
    print(f"verified: {cache.n_layers} layers, {gb_text(nbytes)}, every sha256 matches the manifest "
          f"({nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s, {seconds:.1f} s)", flush=True)
