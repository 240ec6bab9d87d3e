"""`specexec bench attention`: one target pass over a token tree at long contexts, split attention vs a dense mask.

For each context C in --contexts the target's KV cache holds C committed tokens and one pass verifies a tree
of --tree nodes (random shape, random tokens) twice: with the engine's TreeMask (the prefix attended without a
mask, the tree with its ancestor mask, merged by log-sum-exp: specexec/network/attention.py) and with the dense
bool mask over prefix + tree (`prefix_tree_mask`). Rows: context, seconds
per pass each way, their ratio, the max abs difference of the tree's logits, whether every node's greedy
choice (argmax) is the same, and the mask bytes each way builds per forward. A whole pass is dominated by the
linear layers at short contexts and is noisy on a shared machine, so each row also times ONE layer's attention
alone at the model's head shapes (median of --layer-reps calls): split, dense (its mask built once per
forward), and `before`: a dense mask expanded G-fold and converted inside SDPA in every layer (the baseline
the split is measured against). `--json` prints one line. `--repeat N` alternates N rounds of whole passes and keeps
each way's fastest.

The cost of a pass depends on the sizes, not on the values, so the prefix is not prefilled token by token (a
long prefill of a real model would dominate the run on a CPU): a real prefill of --seed-tokens random tokens
is tiled over the C slots. Without --model a tiny random model (the test fixtures' shapes) runs.

Does not know: the engine, builders, sampling (the tree is random; verification is the argmax per node).
"""
from __future__ import annotations

import argparse
import functools
import json
import time

import torch
import torch.nn.functional as F

from specexec.network.attention import attend, build_plan, pick_kernel
from specexec.config import ModelArgs
from specexec.kv.cache import KVCache
from specexec.options import DTYPES, ConfigError, check_choice, check_device, check_integer
from specexec.checkpoints.loading import load_model, resolve_dtype, resolve_model_path
from specexec.network.model import Transformer, TreeMask, prefix_tree_mask
from specexec.tree import TokenTree

TINY = ModelArgs(family="llama", vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                 intermediate_size=128)
UNITS = {"": 1, "k": 1024}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("attention", help="split vs dense-mask attention: seconds per target pass by context",
                       description="Time one target pass over a token tree at each context length with split "
                                   "attention (prefix unmasked + tree mask, merged exactly) and with one dense "
                                   "mask; report the speed-up and that the logits agree.")
    p.add_argument("--model", metavar="PATH|NAME", help="target checkpoint (default: a tiny random model)")
    p.add_argument("--contexts", default="1k,8k,32k", metavar="LIST", help="committed tokens before the tree, "
                   "comma-separated, k = 1024 (default 1k,8k,32k)")
    p.add_argument("--tree", type=int, default=256, metavar="N", help="tree nodes, root included (default 256)")
    p.add_argument("--seed-tokens", type=int, default=256, metavar="N",
                   help="tokens really prefilled, then tiled over the context (default 256)")
    p.add_argument("--device", metavar="DEV", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default="float32", metavar="TYPE", help="float32 (default), bfloat16, float16, auto")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="rounds of split + dense per context; each way's fastest counts (default 1)")
    p.add_argument("--layer-reps", type=int, default=5, metavar="N",
                   help="calls of one layer's attention alone per way; the median counts (default 5)")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON line with the rows")
    return p


def parse_contexts(text: str) -> list[int]:
    """'1k,8k,32k' -> [1024, 8192, 32768]; ConfigError for anything else."""
    out = []
    for item in (t.strip().lower() for t in text.split(",") if t.strip()):
        unit = item[-1] if item[-1] in UNITS else ""
        digits = item[:-1] if unit else item
        if not digits.isdigit() or not 1 <= int(digits) * UNITS[unit] <= 1 << 20:
            raise ConfigError(f"--contexts {text!r}: write lengths like 1k,8k,32k (1 to 1024k tokens)")
        out.append(int(digits) * UNITS[unit])
    if not out:
        raise ConfigError(f"--contexts {text!r}: give at least one length")
    return out


def random_tree(n: int, vocab: int, device: torch.device, seed: int = 0) -> TokenTree:
    """n nodes shaped like a drafted tree: mostly extending recent nodes (deep), sometimes branching early."""
    gen = torch.Generator().manual_seed(seed)
    parents = [-1]
    for i in range(1, n):
        recent = max(0, i - 4)
        parents.append(int(torch.randint(recent if torch.rand((), generator=gen) < 0.7 else 0, i, (), generator=gen)))
    return TokenTree.from_lists(torch.randint(0, vocab, (n,), generator=gen).tolist(), parents, device=device)


def filled_cache(model: Transformer, context: int, extra: int, seed_tokens: int) -> KVCache:
    """A cache of `context` committed slots: a real prefill of seed_tokens random tokens, tiled."""
    a, p = model.args, next(model.parameters())
    cache = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, context + extra, p.dtype, p.device)
    n = min(seed_tokens, context)
    ids = torch.randint(0, a.vocab_size, (1, n), generator=torch.Generator().manual_seed(1)).to(p.device)
    with torch.inference_mode():
        model(ids, torch.arange(n, device=p.device)[None], TreeMask(0), cache)
    for start in range(n, context, n):
        width = min(n, context - start)
        cache.k[:, :, :, start:start + width] = cache.k[:, :, :, :width]
        cache.v[:, :, :, start:start + width] = cache.v[:, :, :, :width]
    cache.length = context
    return cache


def one_pass(model: Transformer, cache: KVCache, tree: TokenTree, mask) -> tuple[float, torch.Tensor]:
    """Seconds of one target forward over the tree, and the tree's fp32 logits [N, V]."""
    L = cache.length
    positions = tree.positions(L)[None]
    slots = torch.arange(L, L + tree.tokens.numel(), device=tree.device)
    _sync(tree.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        hidden = model(tree.tokens[None], positions, mask, cache, slots)
        _sync(tree.device)
        seconds = time.perf_counter() - t0
        return seconds, model.logits(hidden)


def before_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The unsplit baseline: the bool mask [B, 1, T, S] expanded G-fold for the
    folded query and converted to an additive mask inside SDPA, in every layer."""
    B, H, T, D = q.shape
    G, S = H // k.shape[1], mask.shape[-1]
    m = mask.unsqueeze(2).expand(B, 1, G, T, S).reshape(B, 1, G * T, S)
    return F.scaled_dot_product_attention(q.reshape(B, k.shape[1], G * T, D), k, v, attn_mask=m).reshape(B, H, T, D)


def layer_attention(args: ModelArgs, tree: TokenTree, C: int, reps: int, dtype: torch.dtype) -> dict:
    """One layer's attention alone at the model's head shapes (random q/k/v), median of `reps` calls each:
    split and dense plans (built once per forward, so outside the timing) and the per-layer path before."""
    device, T = tree.device, tree.tokens.numel()
    gen = torch.Generator(device).manual_seed(2)
    q = torch.randn(1, args.n_heads, T, args.head_dim, generator=gen, device=device, dtype=dtype)
    k, v = torch.randn(2, 1, args.n_kv_heads, C + T, args.head_dim, generator=gen, device=device, dtype=dtype)
    pos, anc, kernel = tree.positions(C)[None], tree.ancestor_mask(), pick_kernel(device)
    dense = prefix_tree_mask(C, anc, args.sliding_window, pos[0])
    plan = functools.partial(build_plan, positions=pos, n_new=T, window=args.sliding_window,
                             groups=args.n_heads // args.n_kv_heads, dtype=dtype, kernel=kernel)
    calls = {"split": functools.partial(attend, q, k, v, plan(TreeMask(C, anc))),
             "dense": functools.partial(attend, q, k, v, plan(dense)),
             "before": functools.partial(before_attention, q, k, v, dense)}
    out, ms = {}, {}
    with torch.inference_mode():
        for name, call in calls.items():
            out[name] = call()
            ms[name] = _median_ms(call, reps, device)
    diff = max(float((out[n].float() - out["before"].float()).abs().max()) for n in ("split", "dense"))
    return {f"layer_{n}_ms": round(t, 3) for n, t in ms.items()} | {"layer_max_abs_diff": diff}


def _median_ms(call, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        call()
        _sync(device)
        times.append(1000 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def measure(model: Transformer, contexts: list[int], n_nodes: int, seed_tokens: int, repeat: int = 1,
            layer_reps: int = 5) -> list[dict]:
    """One row per context: a warm-up pass, then `repeat` rounds of one split and one dense pass on the same
    cache (each way's fastest round counts); then one layer's attention alone (layer_attention)."""
    device = next(model.parameters()).device
    elem = next(model.parameters()).element_size()
    tree = random_tree(n_nodes, model.args.vocab_size, device)
    anc, rows = tree.ancestor_mask(), []
    for C in contexts:
        cache = filled_cache(model, C, n_nodes, seed_tokens)
        split, dense = TreeMask(C, anc), prefix_tree_mask(C, anc, model.args.sliding_window, tree.positions(C))
        one_pass(model, cache, tree, split)                              # warm-up
        split_s = dense_s = float("inf")
        for _ in range(repeat):                                          # alternating; each one's fastest
            seconds, split_logits = one_pass(model, cache, tree, split)
            split_s = min(split_s, seconds)
            seconds, dense_logits = one_pass(model, cache, tree, dense)
            dense_s = min(dense_s, seconds)
        rows.append({"context": C, "tree": n_nodes, "split_s": round(split_s, 4), "dense_s": round(dense_s, 4),
                     "speedup": round(dense_s / split_s, 3),
                     "max_abs_logit_diff": float((split_logits - dense_logits).abs().max()),
                     "greedy_identical": bool(torch.equal(split_logits.argmax(-1), dense_logits.argmax(-1))),
                     "split_mask_bytes": n_nodes * n_nodes * elem, "dense_mask_bytes": n_nodes * (C + n_nodes) * elem})
        del cache, split_logits, dense_logits
        rows[-1].update(layer_attention(model.args, tree, C, layer_reps, next(model.parameters()).dtype))
    return rows


def table(rows: list[dict], title: str):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in ("context", "pass s split", "dense", "speed-up", "max |Δlogit|", "greedy", "layer ms split",
                "dense", "before", "speed-up"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["context"]), f"{r['split_s']:.3f}", f"{r['dense_s']:.3f}", f"{r['speedup']:.2f}x",
                  f"{r['max_abs_logit_diff']:.1e}", "same" if r["greedy_identical"] else "DIFFERS",
                  f"{r['layer_split_ms']:.1f}", f"{r['layer_dense_ms']:.1f}", f"{r['layer_before_ms']:.1f}",
                  f"{r['layer_before_ms'] / r['layer_split_ms']:.2f}x")
    return t


def run(ns: argparse.Namespace) -> int:
    from rich.console import Console

    device_name = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device_name)
    check_choice("--dtype", ns.dtype, DTYPES)
    check_integer("--tree", ns.tree, 1, 16384)
    check_integer("--seed-tokens", ns.seed_tokens, 1, 65536)
    check_integer("--repeat", ns.repeat, 1, 100)
    check_integer("--layer-reps", ns.layer_reps, 1, 1000)
    contexts = parse_contexts(ns.contexts)
    if ns.threads is not None:
        check_integer("--threads", ns.threads, 1, 1024)
        torch.set_num_threads(ns.threads)
    device = torch.device(device_name)
    if ns.model:
        model = load_model(resolve_model_path(ns.model), device, ns.dtype)
        name = ns.model
    else:
        torch.manual_seed(0)
        model = Transformer(TINY).to(device=device, dtype=resolve_dtype(ns.dtype, device)).eval().requires_grad_(False)
        name = "tiny random"
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    rows = measure(model, contexts, ns.tree, ns.seed_tokens, ns.repeat, ns.layer_reps)
    if ns.json:
        print(json.dumps({"model": name, "device": str(device), "dtype": dtype, "threads": torch.get_num_threads(),
                          "rows": rows}, separators=(",", ":")), flush=True)
    else:
        Console(width=140).print(table(rows, f"bench attention · {name} · {device} {dtype} · {ns.tree}-node tree"))
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
