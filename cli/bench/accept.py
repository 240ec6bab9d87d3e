"""`specexec bench accept`: measure a pair's positional acceptance vector (Sequoia's p_k) per temperature,
cache it where `--builder static` finds it, and print it with the tokens per pass each budget's static tree
is expected to yield.

For each temperature, each prompt's continuation comes from the runtime itself (speculative decoding is exact,
so the text is the target's own, drawn with --seed at T > 0); then both models are teacher-forced over it
(specexec/tuning/acceptance.py says how p_k is counted). Saved to the pair's file under the cache root (or --out),
one vector per temperature, so running it again at another temperature adds to the file.

Does not know: how the vector is measured (specexec.tuning.acceptance), how a shape is chosen (builders/static.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from cli import args as common
from cli.bench.common import encode_prompts
from specexec.options import ConfigError, check_number, parse_float_list
from specexec.tuning import acceptance
from specexec.builders.static import tree_shape
from specexec.config import SamplingParams
from specexec.prompts import load_prompts

SHOW_BUDGETS = (16, 64, 256, 1024)
SHOW_RANKS = 8


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("accept", help="measure the pair's positional acceptance vector for --builder static",
                       description="Measure p_k (the chance that a node's k-th drafted child is the one accepted) "
                                   "on the prompt set at each temperature and cache it for --builder static.")
    common.add_common_args(p, max_new_default="64")
    p.add_argument("--temperatures", default="0,0.6", metavar="LIST", help="temperatures to measure at "
                   "(default 0,0.6; the static builder uses the nearest one)")
    p.add_argument("--positions", type=int, default=acceptance.POSITIONS, metavar="K",
                   help=f"children per node measured (default {acceptance.POSITIONS})")
    p.add_argument("--draws", type=int, default=4, metavar="N", help="draws per position at T > 0 (default 4)")
    p.add_argument("--prompts", metavar="FILE", help="JSONL prompts (default: the built-in set)")
    p.add_argument("--limit", type=int, default=16, metavar="N", help="only the first N prompts (default 16)")
    p.add_argument("--raw", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--out", metavar="FILE", help="write the vectors here instead of the pair's cache file")
    p.add_argument("--json", action="store_true", help="print one JSON line with the vectors")
    return p


def expected_tokens(vector: list[float], budget: int, max_depth: int = 16) -> float:
    """Tokens per pass the static shape for `budget` is expected to yield under `vector` (+1 bonus)."""
    shape = tree_shape(budget, max_depth, tuple(vector))
    return 1.0 + sum(math.exp(v) for v in shape.log_value[1:])


def _check(ns: argparse.Namespace) -> tuple[float, ...]:
    if ns.no_draft or not ns.draft:
        raise ConfigError("bench accept measures a pair: pass --model TARGET and --draft DRAFT")
    check_number("--positions", ns.positions, low=1, high=64)
    check_number("--draws", ns.draws, low=1, high=1000)
    check_number("--limit", ns.limit, low=1, high=10**6)
    temps = parse_float_list("--temperatures", ns.temperatures)
    for t in temps:
        SamplingParams(temperature=t)                       # the one place temperatures are validated
    return temps


def run(ns: argparse.Namespace) -> int:
    console = Console(stderr=True, soft_wrap=True)
    common.apply_catalog_defaults(ns, console)
    temps = _check(ns)
    config = common.engine_config(ns)
    common.refuse_lossy_kv(config, "bench accept")
    common.check_draft(ns, config)
    base = common.sampling_params(ns)
    prompts = load_prompts(ns.prompts)[: ns.limit]
    runtime = common.load_runtime(ns, config, console, common.offload_config(ns))
    warn = lambda msg: console.print(f"warning: {msg}", style="yellow", highlight=False, markup=False)  # noqa: E731
    prompt_ids = encode_prompts(runtime, tuple(prompts), config.max_new_tokens, ns.raw, warn)
    path = Path(ns.out) if ns.out else acceptance.default_path(runtime.pair)
    rows = []
    with console.status("measuring") as status:
        for t in temps:
            sampling = dataclasses.replace(base, temperature=t)
            rows.append(_measure_one(runtime, prompt_ids, sampling, ns, lambda m: status.update(m)))
            acceptance.save(path, t, rows[-1]["acceptance"], positions=rows[-1]["positions"],
                            prompts=len(prompt_ids), max_new_tokens=config.max_new_tokens,
                            target=str(runtime.target_info.path), draft=str(runtime.draft_info.path))
    console.print(f"saved to {path} (used by --builder static for this pair)", style="dim", highlight=False)
    if ns.json:
        print(json.dumps({"path": str(path), "rows": rows}, separators=(",", ":")), flush=True)
    else:
        Console(soft_wrap=True).print(table(rows, f"acceptance · {len(prompt_ids)} prompts"))
    return 0


def _measure_one(runtime, prompt_ids: list[list[int]], sampling: SamplingParams, ns: argparse.Namespace,
                 say) -> dict:
    """Continuations at `sampling`, then the vector over them."""
    seqs, t0 = [], time.perf_counter()
    for j, ids in enumerate(prompt_ids, 1):
        say(f"T={sampling.temperature:g} · generating continuation {j}/{len(prompt_ids)}")
        runtime.engine.reset()
        seeded = dataclasses.replace(sampling, seed=(sampling.seed or 0) + j)
        out = [t for step in runtime.generate_ids(ids, None, seeded) for t in step]
        seqs.append((ids + out, len(ids)))
    say(f"T={sampling.temperature:g} · teacher forcing both models over {len(seqs)} texts")
    gen = torch.Generator(device=runtime.engine.device).manual_seed(sampling.seed or 0)
    vec, n = acceptance.measure(runtime.engine.target, runtime.engine.draft, seqs, sampling, ns.positions,
                                ns.draws, gen)
    if n == 0:
        raise ConfigError("no position to measure: every continuation was empty (raise --max-new-tokens)")
    return {"temperature": sampling.temperature, "positions": n, "acceptance": vec,
            "expected_tokens_per_pass": {b: round(expected_tokens(vec, b), 3) for b in SHOW_BUDGETS},
            "seconds": round(time.perf_counter() - t0, 2)}


def table(rows: list[dict], title: str) -> Table:
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for col in ("T", "positions", *[f"p{k}" for k in range(1, SHOW_RANKS + 1)], "none",
                *[f"E tok/pass @{b}" for b in SHOW_BUDGETS]):
        t.add_column(col, justify="right")
    for r in rows:
        vec = r["acceptance"]
        t.add_row(f"{r['temperature']:g}", str(r["positions"]), *[f"{p:.3f}" for p in vec[:SHOW_RANKS]],
                  *["–"] * (SHOW_RANKS - min(len(vec), SHOW_RANKS)), f"{max(1 - sum(vec), 0):.3f}",
                  *[f"{r['expected_tokens_per_pass'][b]:.2f}" for b in SHOW_BUDGETS])
    return t
