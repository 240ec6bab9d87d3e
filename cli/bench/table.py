"""The prompt-set benchmarks' report: the JSON rows of `specexec bench` (and `bench --endpoint`, whose servers
are rows of the same shape), the comparison table drawn from them, the baselines a row's speed-up is taken
against, and the one cell formatter every bench table uses ("–" for a figure that does not apply).

Does not know: how a row was measured (cli/bench/main.py runs our runtime and the transformers baselines,
cli/bench/endpoint.py a server), the runtime.
"""
from __future__ import annotations

from rich.table import Table

from cli.bench.common import Result, first_mismatch
from specexec.profiler import budget_trace

BASELINES = ("no-draft", "hf-offload", "hf-assisted", "llama.cpp")   # the rows every other row's speed-up is against
EXTERNAL = ("hf-", "llama.cpp")      # rows of other tools: not our runtime, not the same weights' numerics


def cell(x: float | int | None, fmt: str) -> str:
    """One table cell: x formatted by `fmt`, or "–" when the figure does not apply."""
    return "–" if x is None else format(x, fmt)


def _gb(n: int | None) -> float | None:
    return None if n is None else round(n / 1e9, 3)


def _round(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def per_step(r: Result, seconds: float) -> float | None:
    """Milliseconds per step of our rows (None for other tools' rows, which the profiler does not see)."""
    return None if r.config.startswith(EXTERNAL) or not r.passes else round(1000 * seconds / r.passes, 1)


def make_rows(results: list[Result], greedy: bool) -> list[dict]:
    """The JSON rows: one per configuration, with the identical-output check and speed-ups vs each baseline."""
    base = next((r for r in results if r.config == "no-draft"), None)
    baseline_tok_s = {r.config: r.tok_s for r in results if r.config in BASELINES}
    rows = []
    for r in results:
        same = mismatch = None
        if greedy and base is not None:
            same = sum(a == b for a, b in zip(r.outputs, base.outputs))
            mismatch = [first_mismatch(a, b) for a, b in zip(r.outputs, base.outputs)]
        if r.lossy or r.accept != "exact":           # an int8 cache, relaxed acceptance: outside every exactness claim
            same = None
        if r.config.startswith("llama.cpp"):          # other weights (the GGUF's quantization): no comparison at all
            same = mismatch = None
        rows.append({
            "config": r.config, "tok_s": _round(r.tok_s, 3),
            "tokens_per_pass": _round(r.new_tokens / r.passes if r.passes else None, 3),
            "ttft_s": _round(sum(r.ttfts) / len(r.ttfts) if r.ttfts else None, 4),
            "identical_to_baseline": None if same is None else same == len(base.outputs),
            "identical_prompts": None if same is None else f"{same}/{len(base.outputs)}",
            "first_mismatch": mismatch,
            "peak_ram_gb": _gb(r.peak_ram), "peak_vram_gb": _gb(r.peak_vram),
            "new_tokens": r.new_tokens, "passes": r.passes, "decode_s": _round(r.decode_s, 4),
            "draft_ms_per_step": per_step(r, r.draft_s), "target_ms_per_step": per_step(r, r.target_s),
            "speedup": {b: _round(r.tok_s / t, 3) if r.tok_s and t else None for b, t in baseline_tok_s.items()},
            "budget": r.budget, "builder": r.builder, "draft": r.draft, "note": r.note or None, "lossy": r.lossy,
            "accept": None if r.config.startswith((*EXTERNAL, "endpoint")) else r.accept,
            "relaxed_tokens": r.relaxed_tokens if r.accept != "exact" else None,
            "budget_trace": budget_trace(r.budgets) if r.budget == "auto" else None,
            **({"moe": moe} if (moe := r.moe()) is not None else {}),
            **({"gate": gate} if (gate := r.gate()) is not None else {}),
        })
    return rows


def gate_lines(row: dict, most: int = 8) -> list[str]:
    """A gated row's lines: its share of plain steps, then when and why it switched (the last `most`)."""
    gate = row.get("gate")
    if not gate:
        return []
    steps = gate["plain_steps"] + gate["speculative_steps"]
    head = (f"{row['config']}: gate: {gate['switches']} switches, {gate['plain_steps']} of {steps} steps without "
            f"drafting" + (f" ({len(gate['events']) - most} earlier switches not shown)" if len(gate["events"]) > most
                           else ""))
    return [head] + [f"{row['config']}: {e}" for e in gate["events"][-most:]]


def make_table(rows: list[dict], title: str) -> Table:
    """The comparison table of make_rows' rows: one column of speed-up per baseline present."""
    baselines = [b for b in BASELINES if any(r["config"] == b for r in rows)]
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for col in ("config", "tok/s", "tok/pass", "TTFT s", "peak RAM GB", "peak VRAM GB", "accept", "identical (T=0)",
                *[f"× {b}" for b in baselines]):
        t.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        ident = "–" if r["identical_prompts"] is None else \
            f"{'yes' if r['identical_to_baseline'] else 'NO'} {r['identical_prompts']}"
        at = sorted(i for i in r["first_mismatch"] or () if i is not None)
        ident += f" (from token {', '.join(map(str, at))})" if at else ""
        accept = r.get("accept")
        if r.get("lossy") or accept not in (None, "exact"):
            ident = "LOSSY: " + (f"diverges at token {', '.join(map(str, at))}" if at else "same tokens here")
        if accept not in (None, "exact"):
            accept = f"{accept} LOSSY ({r['relaxed_tokens']} relaxed tokens)"
        t.add_row(r["config"], cell(r["tok_s"], ".2f"), cell(r["tokens_per_pass"], ".2f"),
                  cell(r["ttft_s"], ".3f"), cell(r["peak_ram_gb"], ".2f"), cell(r["peak_vram_gb"], ".2f"), accept or "–", ident,
                  *[cell(r["speedup"].get(b), ".2f") for b in baselines])
    return t


def cannot_pay(rows: list[dict]) -> str | None:
    """One line when no drafted row beat the target alone on this pair (why, from the rows' own costs), else
    None: a reader of `x no-draft 0.34` learns that the pair, not the method, sets the speed-up."""
    base = next((r for r in rows if r["config"] == "no-draft" and r["tok_s"]), None)
    drafted = [r for r in rows if r["budget"] is not None and r["tok_s"] and not r["lossy"]]
    if base is None or not drafted or any(r["tok_s"] > base["tok_s"] for r in drafted):
        return None
    best = max(drafted, key=lambda r: r["tok_s"])
    target, draft = base["target_ms_per_step"], best["draft_ms_per_step"]
    cost = (f": a target pass costs {target:.1f} ms and {best['config']}'s draft {draft:.1f} ms a step for "
            f"{best['tokens_per_pass'] or 0:.2f} tokens per pass" if target is not None and draft is not None else "")
    return (f"drafting does not pay on this pair: the target alone ({base['tok_s']:.1f} tok/s) beats every drafted row "
            f"(best {best['tok_s']:.1f}){cost}. Trees pay where a target pass is expensive (a large or offloaded "
            "target) and the draft agrees with it often")
