"""`specexec bench hybrid`: one streamed linear-attention (Gated DeltaNet) layer's tree pass against a dense
attention layer of the same bytes, at several tree sizes.

Both layers get random weights (in --quant's format: none, or the CPU's int8/int4 kernels) and a committed context
of --context tokens in their own cache; the hybrid layer is Qwen3.5-35B-A3B's linear mixer (16 key heads, 32 value
heads of 128, a 4-tap convolution) with a dense MLP of --mlp, the dense layer a Llama-style attention layer (16
heads, 2 KV heads of 128) whose MLP is widened until its packed bytes equal the hybrid layer's. For each tree
size T in --tokens (a tree of branching 4, its nodes' states per branch): the median of --reps passes of each
layer over the same context (scratch only, nothing committed; the two layers take turns pass by pass), and the copy of the layer's packed bytes from RAM
into a slot, as a streamed layer arrives. A streamed pass overlaps the next layer's copy with this one's compute,
so it costs max(copy, compute); rows: tokens, copy_ms, hybrid_ms, dense_ms (compute), ratio of the streamed passes
(and of the compute alone), and the state per node. `--json` prints one line.

Does not know: checkpoints, the pager's threads (the copy is timed on its own), the engine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from cli.bench.components.kernels import parse_rows
from specexec.config import LinearArgs, ModelArgs
from specexec.kv.cache import KVCache
from specexec.network.linear_attention import spec_of
from specexec.network.model import Transformer, TreeMask
from specexec.options import check_choice, check_integer
from specexec.planning.sizes import module_bytes
from specexec.runtime.offloaded import quantize_layers
from specexec.tree import TokenTree

FORMATS = ("none", "int8", "int4")
DIM, HEADS, KV_HEADS, HEAD_DIM = 2048, 16, 2, 128
LINEAR = LinearArgs(k_heads=16, v_heads=32, k_dim=128, v_dim=128, conv_kernel=4, layout="split")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("hybrid", help="a linear-attention layer's tree pass vs a dense layer of the same bytes",
                       description="Time one streamed Gated DeltaNet layer's tree pass (a state per branch) against a "
                                   "dense attention layer of the same packed bytes, per tree size.")
    p.add_argument("--tokens", default="1,16,64,256", metavar="LIST", help="tree sizes, default 1,16,64,256")
    p.add_argument("--context", type=int, default=1024, metavar="N", help="committed tokens (default 1024)")
    p.add_argument("--mlp", type=int, default=6144, metavar="N", help="the hybrid layer's MLP width (default 6144)")
    p.add_argument("--quant", default="none", choices=FORMATS, help="layer format (default none: fp32)")
    p.add_argument("--reps", type=int, default=7, metavar="N", help="passes per size; the median counts")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON line with the rows")
    return p


def layer_args(linear: bool, mlp: int) -> ModelArgs:
    """One decoder layer: the hybrid's linear layer, or a dense attention layer with an MLP of `mlp`."""
    extra = dict(layer_types=("linear_attention",), linear=LINEAR, norm_plus_one=True) if linear else {}
    return ModelArgs(family="bench", vocab_size=256, dim=DIM, n_layers=1, n_heads=HEADS, n_kv_heads=KV_HEADS,
                     head_dim=HEAD_DIM, intermediate_size=mlp, max_position_embeddings=1 << 20, **extra)


def same_bytes_mlp(hybrid: Transformer, fmt: str) -> tuple[Transformer, int]:
    """The dense layer whose bytes are nearest the hybrid layer's: a layer's bytes grow linearly with its MLP
    width, so two small layers give the slope and the width is rounded to a multiple of 64."""
    want = module_bytes(hybrid.layers[0])
    base, wider = (module_bytes(_model(layer_args(False, w), fmt).layers[0]) for w in (64, 128))
    width = max(64, round((64 + (want - base) * 64 / (wider - base)) / 64) * 64)
    dense = _model(layer_args(False, width), fmt)
    return dense, module_bytes(dense.layers[0])


def _model(args: ModelArgs, fmt: str) -> Transformer:
    model = Transformer(args).eval().requires_grad_(False)
    if fmt != "none":
        quantize_layers(model, fmt)
    return model


def tree(n: int) -> TokenTree:
    """n nodes under a root, branching 4 (node i's parent is (i - 1) // 4)."""
    return TokenTree.from_lists([0] * (n + 1), [-1] + [(i - 1) // 4 for i in range(1, n + 1)])


def pass_ms(models: list[Transformer], caches: list[KVCache], context: int, n: int, reps: int) -> list[float]:
    """Median ms of a tree pass of n + 1 nodes (the root) over the committed context, for each model; the models
    take turns pass by pass, so a busy machine slows them alike."""
    t = tree(n)
    x = torch.randn(1, n + 1, DIM, generator=torch.Generator().manual_seed(n))
    pos, mask = t.positions(context)[None], TreeMask(context, t.ancestor_mask())
    times: list[list[float]] = [[] for _ in models]
    for rep in range(reps + 1):                                 # one untimed: the first shape's allocations
        for model, cache, out in zip(models, caches, times):
            t0 = time.perf_counter()
            model.decode(x, pos, mask, cache, None)
            out.append(time.perf_counter() - t0)
    return [statistics.median(out[1:]) * 1e3 for out in times]


def copy_ms(nbytes: int, reps: int) -> float:
    """Median ms of copying a layer's bytes from a RAM buffer into a slot (what a streamed layer's arrival costs)."""
    src, dst = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def prefilled(model: Transformer, context: int, extra: int) -> KVCache:
    cache = model.new_cache(context + extra)
    x = torch.randn(1, context, DIM, generator=torch.Generator().manual_seed(0))
    model.decode(x, torch.arange(context)[None], TreeMask(0), cache, None)
    cache.advance(context)
    return cache


def run(ns: argparse.Namespace) -> int:
    sizes = parse_rows(ns.tokens, "--tokens")
    check_integer("--context", ns.context, low=1, high=1 << 17)
    check_integer("--mlp", ns.mlp, low=64, high=1 << 16)
    check_integer("--reps", ns.reps, low=1, high=1000)
    check_choice("--quant", ns.quant, FORMATS)
    if ns.threads is not None:
        check_integer("--threads", ns.threads, low=1, high=1024)
        torch.set_num_threads(ns.threads)
    with torch.inference_mode():
        hybrid = _model(layer_args(True, ns.mlp), ns.quant)
        dense, dense_bytes = same_bytes_mlp(hybrid, ns.quant)
        nbytes = module_bytes(hybrid.layers[0])
        caches = [prefilled(m, ns.context, max(sizes) + 1) for m in (hybrid, dense)]
        copy = copy_ms(nbytes, ns.reps)
        node = spec_of(hybrid.args).node_bytes(4)
        rows = []
        for n in sizes:
            h, d = pass_ms([hybrid, dense], caches, ns.context, n, ns.reps)
            rows.append({"tokens": n, "copy_ms": round(copy, 3), "hybrid_ms": round(h, 3), "dense_ms": round(d, 3),
                         "streamed_ratio": round(max(h, copy) / max(d, copy), 3), "compute_ratio": round(h / d, 3),
                         "state_bytes": n * node})
    _show(ns, rows, nbytes, dense_bytes, node)
    return 0


def _show(ns: argparse.Namespace, rows: list[dict], nbytes: int, dense_bytes: int, node: int) -> None:
    console = Console(stderr=True, soft_wrap=True) if ns.json else Console(soft_wrap=True)
    t = Table(title=f"one layer, {ns.quant}, {nbytes / 1e6:.0f} MB (dense {dense_bytes / 1e6:.0f} MB), context "
                    f"{ns.context}, {torch.get_num_threads()} threads; state {node / 1e3:.1f} KB per node",
              title_justify="left", show_edge=False, pad_edge=False)
    for col in ("tree nodes", "copy ms", "hybrid ms", "dense ms", "streamed ×", "compute ×"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["tokens"]), f"{r['copy_ms']:.2f}", f"{r['hybrid_ms']:.2f}", f"{r['dense_ms']:.2f}",
                  f"{r['streamed_ratio']:.2f}", f"{r['compute_ratio']:.2f}")
    console.print(t)
    if ns.json:
        print(json.dumps({"quant": ns.quant, "layer_bytes": nbytes, "dense_layer_bytes": dense_bytes,
                          "context": ns.context, "threads": torch.get_num_threads(), "state_bytes_per_node": node,
                          "rows": rows}, separators=(",", ":")))
