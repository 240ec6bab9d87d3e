"""`specexec bench builders`: every tree builder on the same prompts at equal node budgets, one table.

For each temperature: the target alone (the reference: its tok/s is the × column's base, and at T = 0 every
builder's output must equal its output token for token), then each builder at each budget, all variants of
one loaded runtime. Per row: tokens per target pass, draft ms and target ms per step, tokens/s, the acceptance
rule the builder was verified with (its own exact default, docs/algorithms.md §5.5), and at T = 0 whether the
output was identical. After the table, the winner per (temperature, budget) by tokens per pass and by
tokens/s. `--json` prints one line {"rows": [...], "best": [...]}.

Does not know: how builders grow trees (specexec/builders), how a run is timed (cli/bench/common.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from rich.console import Console
from rich.table import Table

from cli import args as common
from cli.bench import plot
from cli.bench.common import Plan, Result, encode_prompts, first_mismatch, run_variant, wide
from cli.bench.table import cell
from specexec.builders.registry import builder_needs_draft, names as builder_names
from specexec.options import ConfigError, check_choice, check_number, help_list, parse_budget_list, parse_float_list
from specexec.prompts import load_prompts
from specexec.runtime.assembly import Runtime

DEFAULT_BUDGETS = "16,64,256,1024"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("builders", help="every tree builder at equal budgets: tokens/pass, draft ms, tok/s",
                       description="Run the prompt set through each tree builder at equal node budgets and "
                                   "temperatures, with the target alone as the reference; print one table.")
    common.add_common_args(p, max_new_default="64")
    p.add_argument("--builders", metavar="LIST",
                   help=f"builders to compare (default all: {help_list(builder_names())})")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, metavar="LIST",
                   help=f"node budgets (default {DEFAULT_BUDGETS})")
    p.add_argument("--temperatures", default="0,0.6", metavar="LIST", help="temperatures (default 0,0.6)")
    p.add_argument("--prompts", metavar="FILE", help="JSONL prompts (default: the built-in set)")
    p.add_argument("--limit", type=int, default=8, metavar="N", help="only the first N prompts (default 8)")
    p.add_argument("--warmup", type=int, default=4, metavar="N", help="untimed warm-up tokens per row (default 4)")
    p.add_argument("--raw", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON line {\"rows\": [...], \"best\": [...]}")
    p.add_argument("--plot", metavar="FILE", help="also draw tok/s and tokens per pass against the budget, one "
                   "panel per temperature, into FILE.png or FILE.svg (needs matplotlib)")
    return p


def parse_builders(text: str | None, has_draft: bool) -> tuple[str, ...]:
    """The builders to run, in registry order when all; drafted builders need a draft."""
    known = builder_names()
    names = list(known) if text is None else [b.strip() for b in text.split(",") if b.strip()]
    for b in names:
        check_choice("--builders", b, known)
    if not names:
        raise ConfigError("--builders lists no builder")
    if not has_draft:
        needs = [b for b in names if builder_needs_draft(b)]
        if text is not None and needs:
            raise ConfigError(f"--builders {', '.join(needs)} need a draft model: pass --draft PATH")
        names = [b for b in names if not builder_needs_draft(b)]
    return tuple(dict.fromkeys(names))


def make_plan(ns: argparse.Namespace) -> tuple[Plan, tuple[str, ...], tuple[float, ...]]:
    if not ns.model:
        raise ConfigError("bench builders needs --model PATH|NAME (and --draft PATH)")
    config = common.engine_config(ns)
    common.refuse_lossy_kv(config, "bench builders")
    sampling = common.sampling_params(ns)
    builders = parse_builders(ns.builders, bool(ns.draft) and not ns.no_draft)
    budgets = parse_budget_list(ns.budgets, auto_supported=False)
    temps = parse_float_list("--temperatures", ns.temperatures)
    for t in temps:
        dataclasses.replace(sampling, temperature=t)            # SamplingParams validates each
    check_number("--limit", ns.limit, low=1, high=10**6)
    check_number("--warmup", ns.warmup, low=0, high=10**4)
    prompts = tuple(load_prompts(ns.prompts)[: ns.limit])
    plan = Plan(config, sampling, common.offload_config(ns), budgets, None, ("specexec", "no-draft"), prompts)
    return plan, builders, temps


def run_all(runtime: Runtime, plan: Plan, builders: tuple[str, ...], temps: tuple[float, ...],
            prompt_ids: list[list[int]], warmup: int, say, done) -> list[dict]:
    rows = []
    for t in temps:
        sampling = dataclasses.replace(plan.sampling, temperature=t)
        base_rt = runtime.variant(plan.config, use_draft=False)
        base = run_variant("target only", base_rt, None, plan, prompt_ids, warmup, say, sampling)
        done(base)
        rows.append(row(base, "target only", None, t, "–", base))
        for name in builders:
            for budget in plan.budgets:
                cfg = plan.config.replace(builder=name, budget=budget, auto_budget=False)
                rt = runtime.variant(cfg)
                rule = rt.engine.rule_for(sampling).name
                res = run_variant(f"{name} budget={budget} T={t:g}", rt, budget, plan, prompt_ids, warmup, say,
                                   sampling)
                done(res)
                rows.append(row(res, name, budget, t, rule, base))
                del rt
    return rows


def row(r: Result, builder: str, budget: int | None, temperature: float, rule: str, base: Result) -> dict:
    steps = r.passes or 0
    same = None
    if temperature == 0 and budget is not None:
        same = [first_mismatch(a, b) for a, b in zip(r.outputs, base.outputs)]
    return {
        "builder": builder, "budget": budget, "temperature": temperature, "rule": rule,
        "tokens_per_pass": round(r.new_tokens / steps, 3) if steps else None,
        "draft_ms_per_step": round(1000 * r.draft_s / steps, 2) if steps else None,
        "target_ms_per_step": round(1000 * r.target_s / steps, 2) if steps else None,
        "tok_s": round(r.tok_s, 3) if r.tok_s else None,
        "speedup": round(r.tok_s / base.tok_s, 3) if r.tok_s and base.tok_s else None,
        "identical": None if same is None else all(m is None for m in same),
        "first_mismatch": same, "new_tokens": r.new_tokens, "passes": r.passes,
    }


def best(rows: list[dict]) -> list[dict]:
    """Per (temperature, budget): the builder with the most tokens per pass and the fastest one."""
    out = []
    keys = dict.fromkeys((r["temperature"], r["budget"]) for r in rows if r["budget"] is not None)
    for t, b in keys:
        group = [r for r in rows if (r["temperature"], r["budget"]) == (t, b)]
        by_pass = max(group, key=lambda r: r["tokens_per_pass"] or 0)
        by_speed = max(group, key=lambda r: r["tok_s"] or 0)
        out.append({"temperature": t, "budget": b, "most_tokens_per_pass": by_pass["builder"],
                    "tokens_per_pass": by_pass["tokens_per_pass"], "fastest": by_speed["builder"],
                    "tok_s": by_speed["tok_s"]})
    return out


def table(rows: list[dict], title: str) -> Table:
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for col in ("T", "builder", "budget", "rule", "tok/pass", "draft ms/step", "target ms/step", "tok/s",
                "× target", "identical (T=0)"):
        t.add_column(col, justify="left" if col in ("builder", "rule") else "right")
    for r in rows:
        ident = "–" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        t.add_row(f"{r['temperature']:g}", r["builder"], cell(r["budget"], "d"), r["rule"],
                  cell(r["tokens_per_pass"], ".2f"), cell(r["draft_ms_per_step"], ".1f"),
                  cell(r["target_ms_per_step"], ".1f"), cell(r["tok_s"], ".2f"), cell(r["speedup"], ".2f"), ident)
    return t


def run(ns: argparse.Namespace) -> int:
    console = Console(stderr=True, soft_wrap=True)
    figure = plot.check_target(ns.plot)
    common.apply_catalog_defaults(ns, console)
    plan, builders, temps = make_plan(ns)
    runtime = common.load_runtime(ns, plan.config, console, plan.offload)
    warn = lambda msg: console.print(f"warning: {msg}", style="yellow", highlight=False, markup=False)  # noqa: E731
    prompt_ids = encode_prompts(runtime, plan.prompts, plan.config.max_new_tokens, ns.raw, warn)

    def done(r: Result) -> None:
        console.print(f"done {r.config}: {r.new_tokens} tokens · {r.passes} passes · "
                      f"{r.tok_s or 0:.2f} tok/s", style="dim", highlight=False, markup=False)

    with console.status("benchmarking builders") as status:
        rows = run_all(runtime, plan, builders, temps, prompt_ids, ns.warmup, status.update, done)
    winners = best(rows)
    title = (f"bench builders · {len(prompt_ids)} prompts · up to {plan.config.max_new_tokens} new tokens · "
             f"{plan.config.device}")
    out = wide(Console(stderr=ns.json, soft_wrap=True))
    out.print(table(rows, title))
    for w in winners:
        out.print(f"T={w['temperature']:g} budget {w['budget']}: most tokens/pass {w['most_tokens_per_pass']} "
                  f"({w['tokens_per_pass']}), fastest {w['fastest']} ({w['tok_s']} tok/s)", highlight=False)
    if figure is not None:
        plot.save(plot.builders_figure(rows, title), figure, rows, title)
        console.print(f"plot written to {figure}", style="dim", highlight=False)
    if ns.json:
        print(json.dumps({"rows": rows, "best": winners, "prompts": len(prompt_ids),
                          "max_new_tokens": plan.config.max_new_tokens, "device": plan.config.device,
                          "model": str(runtime.target_info.path),
                          "draft": str(runtime.draft_info.path) if runtime.draft_info else None},
                         separators=(",", ":")), flush=True)
    return 0
