"""`specexec serve`: an OpenAI-compatible HTTP server over one loaded target (+ draft).

Takes the model, engine, sampling and offload flags that `specexec chat` takes (cli/args.py); the sampling
flags are the defaults for requests that leave a field out, --max-new-tokens the default max_tokens. Binds
--host (default 127.0.0.1: loopback only) and --port (0 picks a free one) BEFORE loading the models, so a busy
port fails at once, then prints `serving MODEL on http://HOST:PORT/v1` to stderr and serves until Ctrl-C or
SIGTERM. --api-key (or $SPECEXEC_API_KEY) makes every route but /health want `Authorization: Bearer KEY`.

The HTTP stack (starlette + uvicorn) is the optional `serve` extra, imported only here and only when serving:
without it the command says `pip install -e '.[serve]'`.

Does not know: routes and request semantics (cli/serve/app.py, specexec/serving/openai_api.py), generation.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path

from rich.console import Console

from cli import args as common
from specexec.options import ConfigError, check_integer

DEFAULT_MAX_TOKENS = 512


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat/completions, streaming)",
                       description="Serve the target model (drafting with --draft) over the OpenAI HTTP API: "
                                   "/v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health, "
                                   "/metrics, and Anthropic's /v1/messages. "
                                   "--parallel requests run at once, their trees in the same target pass; more "
                                   "queue in arrival order.")
    common.add_common_args(p, max_new_default=f"{DEFAULT_MAX_TOKENS}: max_tokens of requests that name none")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, metavar="N", help="TCP port (default 8000; 0 = any free port)")
    g.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' (default "
                   "$SPECEXEC_API_KEY; none: no key)")
    g.add_argument("--served-model-name", metavar="NAME", nargs="+", help="model id in /v1/models and "
                   "responses (default: --model as typed: a catalogue name, a Hub id, a directory's name); further names are aliases requests "
                   "may use (any other name gets 404 model_not_found)")
    common.add_flag(g, "--prompt-cache")
    g.add_argument("--quiet", action="store_true", help="no access log line per request on stderr")
    g.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests that may wait for the engine before new ones get 429 (default 64)")
    g.add_argument("--max-choices", type=int, default=64, metavar="N",
                   help="prompts x n one request may ask for before it gets 400 (default 64): one request holds "
                        "its worker until every choice is done")
    g.add_argument("--parallel", type=int, default=None, metavar="N",
                   help="requests running at once, their trees verified in the same target pass (default: what "
                        "the memory free for their KV caches fits, at most 4; 1 where the model cannot batch)")
    return p


def require_serve_deps() -> None:
    """ConfigError naming the extra to install when starlette or uvicorn is missing."""
    missing = []
    for module in ("starlette", "uvicorn", "anyio"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        names = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
        raise ConfigError(f"`specexec serve` needs {names}, which {'is' if len(missing) == 1 else 'are'} not "
                          "installed: pip install -e '.[serve]' (in the specexec checkout, as the README installs)")


def model_id(model: str, served_name: list[str] | str | None) -> str:
    """The id clients see: --served-model-name's first name, else what --model said: a directory's name, a Hub
    id (ORG/NAME) or a catalogue name as typed (`demo`, not the directory it resolves to). `model` is --model as
    the user typed it, before the catalogue or the Hub turned it into a local path."""
    if served_name:
        return served_name if isinstance(served_name, str) else served_name[0]
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv4 or IPv6); ConfigError when it cannot be had."""
    check_integer("--port", port, 0, 65535)
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def run(args: argparse.Namespace) -> int:
    require_serve_deps()
    console = Console(stderr=True, soft_wrap=True)
    check_integer("--max-queue", args.max_queue, 1, 100_000)
    check_integer("--max-choices", args.max_choices, 1, 100_000)
    if args.parallel is not None:
        check_integer("--parallel", args.parallel, 1, 1024)
    api_key = args.api_key or os.environ.get("SPECEXEC_API_KEY") or None
    typed = args.model                            # `demo` or ORG/NAME, before it becomes a local directory
    common.apply_catalog_defaults(args, console)
    config = common.engine_config(args, auto_budget=True, max_new_tokens=DEFAULT_MAX_TOKENS)
    sampling = common.sampling_params(args)
    offload = common.offload_config(args)
    common.check_draft(args, config)
    common.prompt_cache_size(args)
    sock = listen(args.host, args.port)
    if not is_loopback(args.host) and api_key is None:
        console.print(f"warning: listening on {args.host} without --api-key: anyone who can reach this machine "
                      "can use the model", style="yellow", highlight=False)
    runtime = common.load_runtime(args, config, console, offload, spinner=sys.stderr.isatty())
    common.attach_prompt_cache(args, runtime, console)
    aliases = tuple((args.served_model_name or [])[1:])
    return serve(runtime, sock, model_id(typed, args.served_model_name), sampling, api_key, args.max_queue,
                 console, aliases, args.quiet, args.max_choices, args.parallel)


def serve(runtime, sock: socket.socket, name: str, sampling, api_key: str | None, max_queue: int,
          console: Console, aliases: tuple[str, ...] = (), quiet: bool = False,
          max_choices: int = 64, parallel: int | None = None) -> int:
    """Run the app on `sock` until Ctrl-C / SIGTERM. parallel: --parallel (None: what fits, batching.pool)."""
    import uvicorn

    from cli.generate import print_load_summary
    from cli.serve.app import ServeSettings, build_app
    from specexec.batching.pool import seating
    from specexec.serving.openai_api import ServerDefaults

    print_load_summary(console, runtime)
    seats = seating(runtime, parallel)
    console.print(seats.line(), highlight=False)
    defaults = ServerDefaults(name, sampling, runtime.config.max_new_tokens, aliases,
                              runtime.config.accept)
    log = None if quiet else (lambda line: console.print(line, highlight=False, markup=False))
    app = build_app(runtime, defaults, ServeSettings(api_key=api_key, max_queue=max_queue, access_log=log,
                                                     max_choices=max_choices, parallel=seats.parallel))
    console.print(f"serving {name} on {url_of(sock)}/v1 (Ctrl-C stops)", highlight=False)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    server.run(sockets=[sock])
    return 0
