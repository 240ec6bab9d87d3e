"""`specexec bench agents`: the agent loop of issue 57 through `specexec serve` (in this process, on loopback) with
--prompt-cache: --agents agents, each with a fixed prefix of about --prefix-tokens tokens (its system prompt and
its tools' definitions, different from the first token on) and a conversation that grows by one user message
(about --turn-tokens tokens) and one greedy answer (--max-new-tokens) per turn, --turns turns, the agents
alternating (so the engine's own cache always holds the other agent's prompt). Then the server restarts: the
runtime is loaded again and its prompt cache opens the same directory (nothing in RAM), and the first agent's
first turn is sent again.

Per turn (openai client, /v1/chat/completions): prompt tokens, usage.prompt_tokens_details.cached_tokens, the
tokens computed (prompt - cached) and their share of the prompt, seconds. The goals: computed <= 5 % of the
prompt on every turn after each agent's first; after the restart, cached >= 90 % of the prefix. Exit 1 when a goal
is missed. The cache lives in a fresh directory under the cache root, removed at the end.

Does not know: how blocks are kept (specexec/kv/prefix_cache.py), HTTP routes (cli/serve/app.py).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from cli import args as common
from cli.bench.common import wide
from cli.bench.table import cell
from specexec.options import ConfigError, check_integer, parse_size

NAME = "bench"
TOOL = {"name": "read_file", "description": "Read a file of the repository and return its text.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("agents", help="agents alternating turns over long fixed prefixes through serve "
                       "--prompt-cache: prompt tokens computed per turn, cached tokens after a restart",
                       description="Two agents (by default) alternate turns through serve with a prompt cache; "
                                   "each turn's prompt tokens, cached tokens and computed share, then the same "
                                   "after a server restart.")
    common.add_common_args(p, max_new_default="16")
    p.add_argument("--agents", type=int, default=2, metavar="N", help="agents taking turns (default 2)")
    p.add_argument("--turns", type=int, default=10, metavar="N", help="turns per agent (default 10)")
    p.add_argument("--prefix-tokens", type=int, default=6000, metavar="N",
                   help="tokens of each agent's fixed prefix: system prompt and tool definitions (default 6000)")
    p.add_argument("--turn-tokens", type=int, default=40, metavar="N",
                   help="tokens of each turn's user message, about (default 40)")
    p.add_argument("--prompt-cache", default="4GB", metavar="SIZE", help="the prompt cache's size (default 4GB)")
    p.add_argument("--json", action="store_true", help="print one JSON line {\"turns\": [...]} to stdout")
    return p


@dataclass
class Turn:
    run: str              # "live" | "restart"
    agent: int
    turn: int
    prompt: int
    cached: int
    seconds: float

    @property
    def computed(self) -> int:
        return self.prompt - self.cached

    def json(self) -> dict:
        return {"run": self.run, "agent": self.agent, "turn": self.turn, "prompt_tokens": self.prompt,
                "cached_tokens": self.cached, "computed_tokens": self.computed,
                "computed_share": round(self.computed / self.prompt, 4), "seconds": round(self.seconds, 3)}


def _filler(tokenizer, tokens: int, salt: str) -> str:
    """Text of about `tokens` tokens: the built-in prompts, repeated, after `salt`."""
    from specexec.prompts import load_prompts

    pool = " ".join(p.prompt for p in load_prompts(None))
    text = salt
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += " " + pool
    ids = tokenizer(text)["input_ids"][:tokens]
    return tokenizer.decode(ids, skip_special_tokens=True)


def prefixes(tokenizer, agents: int, tokens: int) -> list[str]:
    """Each agent's system prompt: its name first, its tools' definitions, then filler to about `tokens`."""
    out = []
    for k in range(agents):
        head = f"You are agent {k}, a coding assistant. Tools:\n{json.dumps([TOOL])}\nGuidelines:\n"
        out.append(head + _filler(tokenizer, max(tokens - len(tokenizer(head)["input_ids"]), 1), f"[{k}]"))
    return out


def run_turns(runtime, systems: list[str], user_texts: list[str], turns: int, max_new: int, run: str,
              only_first: bool = False) -> list[Turn]:
    """Serve `runtime` and send the agents' turns, alternating; only_first: each agent's first turn only of
    agent 0."""
    import openai

    from cli.bench.serve import served
    from cli.serve.app import build_app
    from specexec.config import SamplingParams
    from specexec.serving.openai_api import ServerDefaults

    app = build_app(runtime, ServerDefaults(NAME, SamplingParams(), max_new))
    out: list[Turn] = []
    history: list[list[dict]] = [[] for _ in systems]
    with served(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        for t in range(1 if only_first else turns):
            for k, system in enumerate(systems[:1] if only_first else systems):
                history[k].append({"role": "user", "content": f"Turn {t}. {user_texts[t]}"})
                t0 = time.perf_counter()
                r = client.chat.completions.create(model=NAME, max_tokens=max_new, temperature=0,
                                                   messages=[{"role": "system", "content": system}, *history[k]])
                seconds = time.perf_counter() - t0
                history[k].append({"role": "assistant", "content": r.choices[0].message.content or ""})
                details = r.usage.prompt_tokens_details
                out.append(Turn(run, k, t, r.usage.prompt_tokens, details.cached_tokens if details else 0, seconds))
        client.close()
    return out


def run(args: argparse.Namespace) -> int:
    from cli.serve.command import require_serve_deps
    from specexec.runtime import prompt_cache
    from specexec.runtime.tokenizer import encode_messages
    from specexec.tuning.store import cache_dir

    require_serve_deps()
    console = Console(stderr=True, soft_wrap=True)
    for flag, value in (("--agents", args.agents), ("--turns", args.turns), ("--prefix-tokens", args.prefix_tokens),
                        ("--turn-tokens", args.turn_tokens)):
        check_integer(flag, value, 1, 10**6)
    size = parse_size(args.prompt_cache, "--prompt-cache")
    common.apply_catalog_defaults(args, console)
    config = common.engine_config(args, auto_budget=True, max_new_tokens=16)
    common.check_draft(args, config)
    offload = common.offload_config(args)
    runtime = common.load_runtime(args, config, console, offload, spinner=False)
    tok = runtime.tokenizer
    systems = prefixes(tok, args.agents, args.prefix_tokens)
    user_texts = [_filler(tok, args.turn_tokens, f"Question {t}:") for t in range(args.turns)]
    prefix = len(encode_messages(tok, [{"role": "system", "content": systems[0]}], add_generation_prompt=False))
    need = prefix + args.turns * (args.turn_tokens + config.max_new_tokens + 16) + config.max_new_tokens
    if need > runtime.context:
        raise ConfigError(f"the agent loop needs about {need} tokens of context, but this model has "
                          f"{runtime.context}; lower --prefix-tokens or --turns")
    root = cache_dir("prefix")
    root.mkdir(parents=True, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="bench-agents-", dir=root)
    warn = lambda line: console.print(line, highlight=False, markup=False)    # noqa: E731
    try:
        prompt_cache.attach(runtime, size, directory, warn)
        console.print(f"{args.agents} agents x {args.turns} turns, prefix {prefix} tokens ...", highlight=False)
        turns = run_turns(runtime, systems, user_texts, args.turns, config.max_new_tokens, "live")
        runtime.engine.close()
        console.print("restart: the runtime loaded again, the prompt cache opened from disk ...", highlight=False)
        runtime = common.load_runtime(args, config, console, offload, spinner=False)
        prompt_cache.attach(runtime, size, directory, warn)
        turns += run_turns(runtime, systems, user_texts, 1, config.max_new_tokens, "restart", only_first=True)
        runtime.engine.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return report(console, turns, prefix, args.json)


def report(console: Console, turns: list[Turn], prefix: int, as_json: bool) -> int:
    table = Table(title=f"bench agents: prefix {prefix} tokens, greedy")
    for col in ("run", "turn", "agent", "prompt", "cached", "computed", "computed %", "s"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for t in turns:
        table.add_row(t.run, str(t.turn), str(t.agent), str(t.prompt), str(t.cached), str(t.computed),
                      cell(100 * t.computed / t.prompt, ".1f"), cell(t.seconds, ".2f"))
    wide(console).print(table)
    later = [t for t in turns if t.run == "live" and t.turn > 0]
    worst = max((t.computed / t.prompt for t in later), default=0.0)
    restart = next(t for t in turns if t.run == "restart")
    found = min(restart.cached, prefix) / prefix
    console.print(f"turns after the first: at most {100 * worst:.1f} % of the prompt computed (goal <= 5 %); "
                  f"after the restart: {restart.cached} of the prefix's {prefix} tokens cached = {100 * found:.1f} % "
                  "(goal >= 90 %)", highlight=False)
    if as_json:
        print(json.dumps({"prefix_tokens": prefix, "turns": [t.json() for t in turns],
                          "worst_computed_share": round(worst, 4), "restart_cached_share": round(found, 4)}))
    return 0 if worst <= 0.05 and found >= 0.9 else 1
