"""`specexec bench decode`: one resident model's decode pass, loaded as a draft is (`--draft-quant`: its layers
quantized, on a CPU compiled into one call for the whole stack, an int4 draft's LM head int4), against the
weight bytes that pass reads divided by the machine's measured memory bandwidth: how close a draft step is
to the memory-bound ideal.

For each token count T of --tokens: after a --context-token prefill, T tokens in a chain (the catch-up of a
draft after its accepted tokens: T = 1 is a one-token decode) then the LM head on the last row, as the draft
runs it; the median of --reps passes, each seeing the same context (its K/V rows are written past the
prefix and never kept). Bytes per pass: every tensor of the decoder layers and the LM head once (the
embedding rows a pass looks up are left out). Bandwidth: bench kernels' probe (a 1 GiB read, best of 5).
`--json` prints one line.

Does not know: trees, the engine or a target's streaming (bench stream), other kernels (bench kernels).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from cli.bench.components.kernels import parse_rows, read_gbps
from cpu_kernels.build import status
from specexec.checkpoints.loading import read_args, resolve_model_path
from specexec.config import EngineConfig
from specexec.network.model import Transformer, TreeMask
from specexec.options import ConfigError, check_integer
from specexec.planning.sizes import module_bytes
from specexec.runtime.loaders import load_resident

FORMATS = ("none", "int4", "int8")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("decode", help="a draft's decode pass vs its weight bytes / the memory bandwidth",
                       description="Time one resident model's decode pass, loaded as a draft is, against the "
                                   "weight bytes it reads divided by the measured memory bandwidth.")
    p.add_argument("--model", required=True, metavar="PATH|NAME", help="the model (a checkpoint or a name)")
    p.add_argument("--draft-quant", default="int4", choices=FORMATS, help="its layer format (default int4)")
    p.add_argument("--tokens", default="1,2,4", metavar="LIST", help="tokens per pass, default 1,2,4")
    p.add_argument("--context", type=int, default=128, metavar="N", help="prefilled tokens each pass sees "
                   "(default 128)")
    p.add_argument("--reps", type=int, default=30, metavar="N", help="passes per token count; the median counts")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON line with the rows")
    return p


def weight_bytes(model: Transformer) -> int:
    """Bytes of the decoder layers and the LM head (the embedding when tied and not quantized): what one decode
    pass reads once."""
    head = model._modules.get("lm_head")
    return sum(map(module_bytes, model.layers)) + module_bytes(head if head is not None else model.embed_tokens)


def measure(model: Transformer, tokens: list[int], context: int, reps: int) -> list[dict]:
    """[{tokens, ms}] per token count: the median seconds of `reps` chain passes after a `context`-token
    prefill, the LM head on the last row."""
    cache = model.new_cache(context + max(tokens))
    gen = torch.Generator().manual_seed(0)
    vocab = model.args.vocab_size
    rows = []
    with torch.inference_mode():
        ids = torch.randint(0, vocab, (1, context), generator=gen)
        model(ids, torch.arange(context)[None], TreeMask(0), cache)
        cache.keep(torch.arange(context))
        for T in tokens:
            chain = torch.ones(T, T, dtype=torch.bool).tril()
            part, pos = torch.randint(0, vocab, (1, T), generator=gen), torch.arange(context, context + T)[None]
            times = []
            for _ in range(reps + 2):                         # two untimed: the first shapes' scratch
                t0 = time.perf_counter()
                hidden = model(part, pos, TreeMask(context, chain), cache)
                model.logits(hidden[0, -1:])
                times.append(time.perf_counter() - t0)
            rows.append({"tokens": T, "ms": round(statistics.median(times[2:]) * 1e3, 3)})
    return rows


def run(ns: argparse.Namespace) -> int:
    tokens = parse_rows(ns.tokens, "--tokens")
    check_integer("--context", ns.context, low=1, high=1 << 16)
    check_integer("--reps", ns.reps, low=1, high=10_000)
    if ns.threads is not None:
        check_integer("--threads", ns.threads, low=1, high=1024)
        torch.set_num_threads(ns.threads)
    path = resolve_model_path(ns.model)
    args = read_args(path)
    if ns.context + max(tokens) > args.max_position_embeddings:
        raise ConfigError(f"--context {ns.context} + {max(tokens)} tokens is past the model's "
                          f"{args.max_position_embeddings} positions; pass a smaller --context")
    console = Console(stderr=True, soft_wrap=True)
    console.print(status(), style="dim", highlight=False, markup=False)
    model, info = load_resident(path, args, EngineConfig(device="cpu"), False, ns.draft_quant, draft=True)
    nbytes, gbps = weight_bytes(model), read_gbps()
    bound_ms = nbytes / gbps / 1e6
    rows = [r | {"bound_ms": round(bound_ms, 6), "x_bound": round(r["ms"] / bound_ms, 3)}
            for r in measure(model, tokens, ns.context, ns.reps)]
    t = Table(title=f"{path.name} · {info.dtype} · {nbytes / 1e6:.0f} MB a pass · {torch.get_num_threads()} "
                    f"threads · memory read {gbps:.1f} GB/s", title_justify="left", show_edge=False, pad_edge=False)
    for col in ("tokens", "ms a pass", "bytes / bandwidth ms", "× bound"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["tokens"]), f"{r['ms']:.2f}", f"{r['bound_ms']:.2f}", f"{r['x_bound']:.2f}")
    (console if ns.json else Console(soft_wrap=True)).print(t)
    if ns.json:
        print(json.dumps({"model": str(path), "dtype": info.dtype, "weight_bytes": nbytes, "read_gbps": round(gbps, 2),
                          "threads": torch.get_num_threads(), "context": ns.context, "rows": rows,
                          "kernels": status()}, separators=(",", ":")))
    return 0
