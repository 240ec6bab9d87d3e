"""`specexec bench moe --synthetic WORLD`: expert-aware trees against node-count budgets on a streamed MoE whose
passes cost the experts they read (docs/algorithms.md §22), in a synthetic world on a CPU (cli/bench/components/moe_world.py).

Rows: the target alone (one row per pass, one token: what speculation must beat), the node-count budgets (`--node-budgets`, the tree as grown, what `--budget N --expert-trim off` runs)
and the expert-aware trees (`--budgets`: grown to B nodes, then trimmed by specexec/companions/experts.py with
--expert-trim experts, the engine's own code). Per row: tokens/s, tokens per pass, rows verified, distinct
experts per layer, and the predicted and realised seconds per pass (realised: the world's cost of the experts
the kept rows actually read). Then per expert-aware row the node-count budget's tokens/s at the SAME realised
pass time (interpolated between the two node-count rows around it) and the ratio. `--json` prints one line
{"world": {...}, "rows": [...], "equal_time": [...]}.

The worlds (--synthetic) take the `specexec plan` figures of a real target on a 24 GB card with 64 GB RAM:
its streamed sparse layers, experts per layer, top-k, one NF4 expert's bytes and the tiers' bandwidths (RAM
25 GB/s, SSD 3 GB/s), folded into WORLD_LAYERS simulated layers (each standing for its share of the real ones);
the rest of a pass (dense parts, compute) and the draft's cost are stated assumptions (moe_world.World).

Does not know: real models (the runtime's own runs report stats.moe: `specexec generate --json`).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch
from rich.console import Console
from rich.table import Table

from cli.bench.components.moe_world import FakeTarget, World, WorldRun
from cli.bench.table import cell
from specexec.companions.experts import ExpertPasses
from specexec.options import check_number, parse_budget_list
from specexec.profiler import Profiler

WORLD_LAYERS = 8
WARMUP = 20                       # steps before the figures count (routing and calibration learn)


def _world(streamed: int, experts: int, top_k: int, expert_mb: float, seconds_per_byte: float, base_s: float
           ) -> World:
    """A World standing for `streamed` real sparse layers folded into WORLD_LAYERS."""
    return World(layers=WORLD_LAYERS, experts=experts, top_k=top_k, base_s=base_s,
                 expert_s=expert_mb * 1e6 * seconds_per_byte * streamed / WORLD_LAYERS,
                 peak=0.05, peak_hard=1.0, hard=0.5, draft_s_per_node=0.0001)


# From `specexec plan --gpu-memory 24GB --ram-budget 64GB --quant nf4` (this branch's figures):
WORLDS = {
    # 27 of 36 sparse layers streamed from RAM; 128 experts, top-4, 14.02 MB each
    "gpt-oss-120b": _world(27, 128, 4, 14.02, 1 / 25e9, base_s=0.05),
    # 10 of 32 streamed from RAM; 8 experts, top-2, 99.09 MB each
    "mixtral-8x7b": _world(10, 8, 2, 99.09, 1 / 25e9, base_s=0.05),
    # 83 of 94 streamed, 42 from RAM and 41 from the SSD; 128 experts, top-8, 10.62 MB each
    "qwen3-235b-a22b": _world(83, 128, 8, 10.62, (42 / 25e9 + 41 / 3e9) / 83, base_s=0.6),
}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("moe", help="expert-aware trees vs node-count budgets on a streamed MoE (synthetic)",
                       description="Grow draft trees in a synthetic streamed mixture of experts and compare the "
                                   "expert-aware trim with node-count budgets at equal pass time.")
    p.add_argument("--synthetic", required=True, choices=sorted(WORLDS), help="the target whose plan the world takes")
    p.add_argument("--budgets", default="16,64", metavar="LIST", help="growth budgets of the expert-aware rows "
                   "(default 16,64)")
    p.add_argument("--node-budgets", default="1,2,4,8,16,32", metavar="LIST",
                   help="node-count budgets (default 1,2,4,8,16,32)")
    p.add_argument("--steps", type=int, default=200, metavar="N", help=f"steps per row after {WARMUP} warm-up "
                   "steps (default 200)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="the world's seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    return p


def run_row(world: World, budget: int, mode: str, steps: int) -> dict:
    """`steps` steps of growth budget `budget` under trim `mode` ("off": the node-count budget itself)."""
    run, target, profiler = WorldRun(world), FakeTarget(), Profiler()
    L = world.layers
    ep = ExpertPasses(world.args(), torch.full((L,), world.expert_s), 0, base=lambda rows: world.base_s,
                      mode=mode, held=torch.zeros(L, world.experts, dtype=torch.bool))
    total = {"tokens": 0, "seconds": 0.0, "rows": 0, "distinct": 0.0, "predicted": 0.0}
    draft_s = world.draft_s_per_node * budget
    for step in range(WARMUP + steps):
        tree, kid_q, kid_at = run.grow(budget)
        ep.draft_s = draft_s
        kept = ep.trim(tree, target)
        keep = ep._keep if ep._keep is not None else torch.arange(tree.tokens.numel())
        routing = run.routing(tree.tokens[keep])
        target.routing.begin()
        for layer in range(L):
            target.routing.layers[layer] = routing[:, layer]
        path = run.accept(tree, kid_q, kid_at, keep)
        where = {int(g): j for j, g in enumerate(keep.tolist())}
        predicted = ep.cost(target).seconds(ep.routing.node_probs(kept.tokens))
        ep.observe(kept, [where[n] for n in path], target, profiler, None)
        if step >= WARMUP:
            total["tokens"] += len(path)
            total["seconds"] += draft_s + run.pass_seconds(routing)
            total["rows"] += keep.numel()
            total["distinct"] += sum(torch.unique(routing[:, j]).numel() for j in range(L)) / L
            total["predicted"] += predicted
    n = steps
    return {"rows_kind": "experts" if mode == "experts" else "nodes", "budget": budget,
            "tok_s": round(total["tokens"] / total["seconds"], 3), "tokens_per_pass": round(total["tokens"] / n, 3),
            "rows_per_pass": round(total["rows"] / n, 2), "distinct_experts_per_layer": round(total["distinct"] / n, 2),
            "predicted_s_per_pass": round(total["predicted"] / n, 4),
            "s_per_pass": round((total["seconds"] - n * draft_s) / n, 4), "draft_s": draft_s}


def alone_row(world: World, steps: int) -> dict:
    """The target alone in the same world: each pass verifies one row (the root) and yields one token, so it
    reads only that row's top-k experts per layer; no draft. The row every speculative row must beat."""
    run = WorldRun(world)
    seconds, distinct = 0.0, 0.0
    for step in range(WARMUP + steps):
        routing = run.routing(torch.tensor([run.root]))
        run.root = int(torch.multinomial(run.token_p, 1, generator=run.g))
        if step >= WARMUP:
            seconds += run.pass_seconds(routing)
            distinct += sum(torch.unique(routing[:, j]).numel() for j in range(world.layers)) / world.layers
    s = seconds / steps
    return {"rows_kind": "alone", "budget": 0, "tok_s": round(1 / s, 3), "tokens_per_pass": 1.0,
            "rows_per_pass": 1.0, "distinct_experts_per_layer": round(distinct / steps, 2),
            "predicted_s_per_pass": round(s, 4), "s_per_pass": round(s, 4), "draft_s": 0.0}


def equal_time(rows: list[dict]) -> list[dict]:
    """Per expert-aware row: the node-count budgets' tokens/s at its realised pass time (linear between the
    two node rows around it; None outside their range) and the ratio."""
    nodes = sorted((r for r in rows if r["rows_kind"] == "nodes"), key=lambda r: r["s_per_pass"])
    out = []
    for r in (r for r in rows if r["rows_kind"] == "experts"):
        t = r["s_per_pass"]
        pair = next(((a, b) for a, b in zip(nodes, nodes[1:]) if a["s_per_pass"] <= t <= b["s_per_pass"]), None)
        base = None
        if pair is not None:
            a, b = pair
            w = 0.0 if b["s_per_pass"] == a["s_per_pass"] else (t - a["s_per_pass"]) / (b["s_per_pass"] - a["s_per_pass"])
            base = round(a["tok_s"] + w * (b["tok_s"] - a["tok_s"]), 3)
        out.append({"budget": r["budget"], "s_per_pass": t, "tok_s": r["tok_s"], "node_budget_tok_s": base,
                    "ratio": round(r["tok_s"] / base, 3) if base else None})
    return out


def run(ns: argparse.Namespace) -> int:
    check_number("--steps", ns.steps, low=1, high=10**6)
    world = replace(WORLDS[ns.synthetic], seed=ns.seed)
    rows = [alone_row(world, ns.steps)]
    rows += [run_row(world, n, "off", ns.steps) for n in parse_budget_list(ns.node_budgets, auto_supported=False)]
    rows += [run_row(world, b, "experts", ns.steps) for b in parse_budget_list(ns.budgets, auto_supported=False)]
    same = equal_time(rows)
    if ns.json:
        print(json.dumps({"world": {"name": ns.synthetic, **world.to_json()}, "rows": rows, "equal_time": same},
                         separators=(",", ":")), flush=True)
        return 0
    console = Console()
    console.print(_table(ns.synthetic, world, rows))
    for s in same:
        console.print(f"expert-aware B{s['budget']}: {s['tok_s']:.2f} tok/s at {s['s_per_pass']:.3f} s/pass; node "
                      f"budget at the same pass time: {cell(s['node_budget_tok_s'], '.2f')} tok/s "
                      f"(x{cell(s['ratio'], '.2f')}); x{s['tok_s'] / rows[0]['tok_s']:.2f} the target alone "
                      f"({rows[0]['tok_s']:.2f} tok/s)", highlight=False)
    return 0


def _table(name: str, world: World, rows: list[dict]) -> Table:
    t = Table(title=f"bench moe --synthetic {name}: {world.experts} experts top-{world.top_k}, "
                    f"{world.expert_s * 1e3:.2f} ms per expert x {world.layers} layers, base {world.base_s:.3f} s")
    for col in ("trees", "budget", "tok/s", "tokens/pass", "rows", "experts/layer", "predicted s", "s/pass"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["rows_kind"], str(r["budget"]), f"{r['tok_s']:.2f}", f"{r['tokens_per_pass']:.2f}",
                  f"{r['rows_per_pass']:.1f}", f"{r['distinct_experts_per_layer']:.1f}",
                  f"{r['predicted_s_per_pass']:.3f}", f"{r['s_per_pass']:.3f}")
    return t
