"""`specexec bench --endpoint URL [--endpoint URL2 ...]`: the end-to-end benchmark's prompt set and table, measured
against any OpenAI-compatible server (our own `specexec serve`, vLLM, SGLang, llama.cpp's server, ...), so one
command compares them, or compares a server with a local `specexec bench` run on the same prompts.

Per prompt: one streaming chat completion (a text completion with --raw) with `stream_options.include_usage`,
greedy unless --temperature says otherwise, max_tokens = --max-new-tokens, the prompt's system message when it has
one. ttft_s = request sent -> first streamed text; decode seconds = first streamed text -> end of the stream;
tok_s = completion tokens (the server's usage; the count of streamed text pieces when it reports none) / decode
seconds summed over prompts; tokens per pass is unknown from outside (–). With --repeat N each endpoint runs the
prompt set N times and keeps its fastest round. The server applies its own chat template.

Only the standard library speaks HTTP here (urllib; server-sent events read line by line). HTTP errors and
unreachable servers are one line (exit 2).

Does not know: how the server decodes; our runtime (nothing is loaded locally).
"""
from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from rich.console import Console

from cli.bench import plot
from cli.bench.common import Result, wide
from cli.bench.table import make_rows, make_table
from specexec.options import ConfigError, check_number
from specexec.prompts import Prompt, load_prompts

TIMEOUT_S = 600.0
WARMUP_PROMPT = "Hello"


@dataclass(frozen=True)
class Endpoint:
    """One server: its base URL (ending in /v1), API key and the model name requests carry."""

    base: str
    api_key: str | None
    model: str


@dataclass
class Sample:
    tokens: int
    ttft_s: float | None
    decode_s: float


def base_url(url: str) -> str:
    """http://host:port, http://host:port/ or http://host:port/v1 -> http://host:port/v1."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--endpoint {url!r}: give an http:// or https:// URL, e.g. http://127.0.0.1:8000/v1")
    return url if url.endswith("/v1") else url + "/v1"


def _request(ep_base: str, api_key: str | None, path: str, body: dict | None = None):
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(ep_base + path, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        return urllib.request.urlopen(req, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        raise ConfigError(f"{ep_base}{path} answered HTTP {e.code}: {_error_text(e)}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ConfigError(f"cannot reach {ep_base}{path}: {reason}; is the server running?") from None


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(e.read().decode("utf-8", "replace"))
        err = body.get("error", body)
        return str(err.get("message", err) if isinstance(err, dict) else err)[:200]
    except (ValueError, OSError, AttributeError):
        return e.reason or "error"


def served_model(ep_base: str, api_key: str | None) -> str:
    """The first model id GET /v1/models lists."""
    with _request(ep_base, api_key, "/models") as resp:
        try:
            ids = [m["id"] for m in json.loads(resp.read())["data"]]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{ep_base}/models did not list models as OpenAI's API does; pass --model") from None
    if not ids:
        raise ConfigError(f"{ep_base}/models lists no model; pass --model NAME")
    return ids[0]


def request_body(ep: Endpoint, prompt: Prompt, max_tokens: int, sampling: dict, raw: bool) -> tuple[str, dict]:
    """(path, JSON body) of one streamed request."""
    body = {"model": ep.model, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}
    if raw:
        return "/completions", {**body, "prompt": prompt.prompt}
    messages = ([{"role": "system", "content": prompt.system}] if prompt.system else []) + \
        [{"role": "user", "content": prompt.prompt}]
    return "/chat/completions", {**body, "messages": messages}


def stream_one(ep: Endpoint, prompt: Prompt, max_tokens: int, sampling: dict, raw: bool) -> Sample:
    """One streamed request, timed: tokens, time to the first text, seconds from the first text to the end."""
    path, body = request_body(ep, prompt, max_tokens, sampling, raw)
    pieces, usage, first, last = 0, None, None, None
    start = time.perf_counter()
    with _request(ep.base, ep.api_key, path, body) as resp:
        for raw_line in resp:
            line = raw_line.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") if not raw else choice.get("text")
                if text:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last, pieces = now, pieces + 1
    end = time.perf_counter() if last is None else last
    tokens = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") is not None else pieces
    return Sample(tokens, None if first is None else first - start, max(end - (first or end), 0.0))


def run_endpoint(ep: Endpoint, prompts: list[Prompt], max_tokens: int, sampling: dict, raw: bool, warmup: int,
                 repeat: int, say) -> Result:
    """The prompt set through one endpoint, `repeat` rounds, the fastest kept."""
    if warmup:
        stream_one(ep, Prompt(id="warmup", category="warmup", prompt=WARMUP_PROMPT), warmup, sampling, raw)
    best: Result | None = None
    for round_ in range(repeat):
        res = Result(f"endpoint {ep.model} @ {ep.base}")
        res.peak_ram = None
        for j, p in enumerate(prompts, 1):
            say(f"{ep.base} · round {round_ + 1}/{repeat} · prompt {j}/{len(prompts)}")
            s = stream_one(ep, p, max_tokens, sampling, raw)
            res.new_tokens += s.tokens
            res.decode_s += s.decode_s
            if s.ttft_s is not None:
                res.ttfts.append(s.ttft_s)
        if best is None or (res.tok_s or 0) > (best.tok_s or 0):
            best = res
    return best


def sampling_fields(args: argparse.Namespace) -> dict:
    """The OpenAI request fields for the sampling flags given (temperature 0 unless set)."""
    out = {"temperature": args.temperature if args.temperature is not None else 0.0}
    for name in ("top_p", "seed", "presence_penalty", "frequency_penalty"):
        if getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    return out


def check_flags(args: argparse.Namespace) -> None:
    """Flags of the local benchmark that mean nothing against a server."""
    for flag, given in (("--draft", args.draft), ("--no-draft", args.no_draft), ("--budgets", args.budgets),
                        ("--configs", args.configs), ("--budget", args.budget), ("--offline", args.offline)):
        if given:
            raise ConfigError(f"{flag} does not apply with --endpoint: the server decodes as it was started")


def run(args: argparse.Namespace) -> int:
    check_flags(args)
    figure = plot.check_target(args.plot)
    prompts = load_prompts(args.prompts)
    if args.limit is not None:
        check_number("--limit", args.limit, low=1, high=10**6)
        prompts = prompts[:args.limit]
    max_tokens = args.max_new_tokens or 128
    check_number("--max-new-tokens", max_tokens, low=1, high=10**6)
    check_number("--repeat", args.repeat, low=1, high=100)
    check_number("--warmup", args.warmup, low=0, high=10**4)
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    bases = [base_url(u) for u in args.endpoint]
    console = Console(stderr=True, soft_wrap=True)
    results = []
    with console.status("benchmarking endpoints") as status:
        for b in bases:
            ep = Endpoint(b, key, args.model or served_model(b, key))
            results.append(run_endpoint(ep, prompts, max_tokens, sampling_fields(args), args.raw, args.warmup,
                                        args.repeat, status.update))
    rows = make_rows(results, greedy=False)
    title = (f"{len(prompts)} prompts · up to {max_tokens} new tokens · temperature "
             f"{sampling_fields(args)['temperature']} · {len(bases)} endpoint(s)")
    out = wide(console if args.json else Console(soft_wrap=True))
    out.print(make_table(rows, title))
    if figure is not None:
        plot.save(plot.bench_figure(rows, title), figure, rows, title)
        console.print(f"plot written to {figure}", style="dim", highlight=False)
    if args.json:
        print(json.dumps({"rows": rows, "prompts": len(prompts), "max_new_tokens": max_tokens,
                          "temperature": sampling_fields(args)["temperature"], "endpoints": bases},
                         separators=(",", ":")), flush=True)
    return 0
