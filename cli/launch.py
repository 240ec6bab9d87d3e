"""`specexec launch AGENT`: a coding agent (claude, codex, opencode) pointed at a local `specexec serve`.

`specexec launch AGENT [--url URL] [--api-key KEY] [--agent-command CMD] [SERVE FLAGS ...] [-- AGENT ARGS ...]`.
With --url, that server is used (its model id read from /v1/models). Without it, a server already answering
/health on the serve flags' --host/--port (default 127.0.0.1:8000) is used; else `specexec serve` starts with
the serve flags (on a free port unless --port is given, with a fresh random API key), and stops (SIGTERM, then
SIGKILL after 10 s) when the agent exits. The agent runs with its environment set:

- claude: ANTHROPIC_BASE_URL, ANTHROPIC_AUTH_TOKEN and ANTHROPIC_API_KEY, ANTHROPIC_MODEL and the small/fast
  and default-tier model names (all the served model), CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1;
- codex: a model provider `specexec` given with -c (base_url URL/v1, wire_api responses, env_key
  SPECEXEC_API_KEY) and -m MODEL before the agent args;
- opencode: OPENCODE_CONFIG (a file written for the run) and OPENCODE_CONFIG_CONTENT: a provider `specexec`
  (@ai-sdk/openai-compatible at URL/v1) and model specexec/MODEL;
- every agent also gets OPENAI_BASE_URL (URL/v1), OPENAI_API_KEY, SPECEXEC_URL, SPECEXEC_API_KEY and
  SPECEXEC_MODEL.

--agent-command replaces the agent's program (a wrapper, or a stand-in in tests); the exit code is the agent's.
An agent that is not installed, a server that does not come up, or a --url that does not answer is one line.

Does not know: how the server serves (cli/serve/), the agents beyond their documented settings.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from specexec.options import ConfigError

AGENTS = {"claude": "claude", "codex": "codex", "opencode": "opencode"}
INSTALL = {"claude": "npm install -g @anthropic-ai/claude-code", "codex": "npm install -g @openai/codex",
           "opencode": "npm install -g opencode-ai"}
START_TIMEOUT = 600.0              # seconds a started server may take to load its models
OWN_FLAGS = ("--url", "--api-key", "--agent-command")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("launch", help="run a coding agent (claude, codex, opencode) on a local specexec serve",
                       description="Run a coding agent with its environment pointed at `specexec serve`: the "
                                   "server at --url, or one already running on --host/--port, or one started "
                                   "with the serve flags given here (stopped when the agent exits). Flags after "
                                   "`--` go to the agent.")
    p.add_argument("agent", choices=sorted(AGENTS), metavar="AGENT", help="claude, codex or opencode")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="...",
                   help="--url URL (a running server), --api-key KEY (its key), --agent-command CMD (the program "
                        "to run instead of the agent's own), `specexec serve` flags (--model, --draft, --port, ...) "
                        "for a server this command starts, then -- and the agent's own arguments")
    return p


def split_rest(rest: list[str]) -> tuple[dict[str, str], list[str], list[str]]:
    """(launch's own flags, serve flags, agent args) of the words after AGENT."""
    if "--" in rest:
        at = rest.index("--")
        words, agent_args = rest[:at], rest[at + 1:]
    else:
        words, agent_args = rest, []
    own: dict[str, str] = {}
    serve: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        name, eq, value = word.partition("=")
        if name in OWN_FLAGS:
            if not eq:
                if i + 1 >= len(words):
                    raise ConfigError(f"{name} needs a value")
                value, i = words[i + 1], i + 1
            own[name[2:].replace("-", "_")] = value
        else:
            serve.append(word)
        i += 1
    return own, serve, agent_args


def _flag(words: list[str], name: str, default: str) -> str:
    for i, w in enumerate(words):
        if w == name and i + 1 < len(words):
            return words[i + 1]
        if w.startswith(name + "="):
            return w.split("=", 1)[1]
    return default


def get_json(url: str, key: str | None, timeout: float = 5.0) -> dict | None:
    """GET url -> its JSON object, or None when nothing answers there."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            data = json.loads(r.read())
    except (OSError, ValueError, urllib.error.URLError):
        return None
    return data if isinstance(data, dict) else None


def served_model(url: str, key: str | None) -> str:
    """The first model id /v1/models lists; ConfigError when the server does not answer."""
    models = get_json(f"{url}/v1/models", key)
    data = models.get("data") if models else None
    if not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise ConfigError(f"no specexec server answers at {url} (GET {url}/v1/models failed); start one with "
                          "`specexec serve`, or leave out --url to let `specexec launch` start it")
    return str(data[0]["id"])


class StartedServer:
    """`specexec serve` run as a child process: its URL read from its start line; stop() ends it."""

    def __init__(self, serve_flags: list[str], key: str) -> None:
        code = "import sys; from cli.main import main; sys.exit(main())"
        argv = [sys.executable, "-c", code, "serve", *serve_flags, "--api-key", key]
        if _flag(serve_flags, "--port", "") == "":
            argv += ["--port", "0"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._drain, name="specexec-launch-serve", daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if self.url is None and line.startswith("serving ") and " on http" in line:
                self.url = line.split(" on ", 1)[1].split()[0].removesuffix("/v1")
                self._ready.set()
        self._ready.set()

    def wait(self, timeout: float = START_TIMEOUT) -> str:
        """The server's base URL once it serves; ConfigError with its last line when it fails to."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if time.monotonic() > deadline:
                self.stop()
                raise ConfigError(f"`specexec serve` did not start within {timeout:.0f} s")
        if self.url is None:
            self.proc.wait()
            last = next((ln for ln in reversed(self.lines) if ln.strip()), "no output")
            raise ConfigError(f"`specexec serve` did not start (exit {self.proc.returncode}): {last}")
        return self.url

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def agent_setup(agent: str, url: str, key: str, model: str, workdir: Path) -> tuple[dict[str, str], list[str]]:
    """(environment variables, arguments before the user's) that point `agent` at the server."""
    env = {"OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": key, "SPECEXEC_URL": url, "SPECEXEC_API_KEY": key,
           "SPECEXEC_MODEL": model}
    args: list[str] = []
    if agent == "claude":
        env |= {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": key, "ANTHROPIC_API_KEY": key,
                "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
                "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
                "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    elif agent == "codex":
        provider = {"name": '"specexec"', "base_url": json.dumps(f"{url}/v1"), "env_key": '"SPECEXEC_API_KEY"',
                    "wire_api": '"responses"'}
        args = ["-c", 'model_provider="specexec"']
        for name, value in provider.items():
            args += ["-c", f"model_providers.specexec.{name}={value}"]
        args += ["-m", model]
    elif agent == "opencode":
        config = {"$schema": "https://opencode.ai/config.json", "model": f"specexec/{model}",
                  "provider": {"specexec": {"npm": "@ai-sdk/openai-compatible", "name": "specexec",
                                            "options": {"baseURL": f"{url}/v1", "apiKey": key},
                                            "models": {model: {"name": model}}}}}
        path = workdir / "opencode.json"
        path.write_text(json.dumps(config, indent=2))
        env |= {"OPENCODE_CONFIG": str(path), "OPENCODE_CONFIG_CONTENT": json.dumps(config)}
    return env, args


def agent_program(agent: str, command: str | None) -> list[str]:
    """The agent's argv head: --agent-command's words, else its program on PATH (ConfigError when missing)."""
    if command:
        return shlex.split(command)
    program = shutil.which(AGENTS[agent])
    if program is None:
        raise ConfigError(f"{AGENTS[agent]} is not installed (not on PATH): {INSTALL[agent]}, or name the "
                          "program with --agent-command")
    return [program]


def run(args: argparse.Namespace) -> int:
    own, serve_flags, agent_args = split_rest(args.rest)
    head = agent_program(args.agent, own.get("agent_command"))
    key = own.get("api_key") or os.environ.get("SPECEXEC_API_KEY")
    server: StartedServer | None = None
    if own.get("url"):
        url = own["url"].rstrip("/").removesuffix("/v1")
    else:
        host, port = _flag(serve_flags, "--host", "127.0.0.1"), _flag(serve_flags, "--port", "8000")
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        if get_json(f"{url}/health", None, timeout=2.0) is None:
            key = secrets.token_urlsafe(24)
            print("launch: starting `specexec serve` (it stops when the agent exits)", file=sys.stderr, flush=True)
            server = StartedServer(serve_flags, key)
            url = server.wait()
    try:
        key = key or "specexec"
        model = served_model(url, key)
        print(f"launch: {args.agent} on {url} (model {model})", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="specexec-launch-") as workdir:
            env, pre = agent_setup(args.agent, url, key, model, Path(workdir))
            return subprocess.call([*head, *pre, *agent_args], env={**os.environ, **env})
    finally:
        if server is not None:
            server.stop()
