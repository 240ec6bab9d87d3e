"""The first run of `specexec chat --model ORG/NAME` on an empty machine, through a pseudo-terminal, against the
local Hub stand-in (tests/checkpoints/hub_server.py): the download bars (target, then the draft), the conversion bar (the
layer cache being quantized, with its ETA column), the offload plan, then the prompt and an answer. HOME,
HF_HOME and SPECEXEC_CACHE point at an empty temporary directory. A second start with --offline asks nothing
of the Hub, downloads nothing and converts nothing: everything it needs is on disk."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from offload.quant.weights import auto_format
from tests.checkpoints.hub_server import LocalHub, serve, stop

ROOT = Path(__file__).resolve().parents[2]
FORMAT = auto_format("cpu")          # --quant auto: what streamed layers are packed in on this (CPU) machine
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
TARGET, DRAFT = "tiny-org/tiny-target", "tiny-org/tiny-draft"
LOADED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "model.safetensors")


def screen_text(raw: str) -> str:
    """What the terminal shows at the end: escapes dropped, each line's last carriage-return redraw kept."""
    lines = []
    for line in ANSI.sub("", raw).replace("\r\n", "\n").split("\n"):
        parts = [p for p in line.split("\r") if p.strip()]
        lines.append(parts[-1].rstrip() if parts else "")
    return "\n".join(lines)


@pytest.fixture
def hub(tiny_pair):
    local = LocalHub()
    local.add_dir(TARGET, tiny_pair[0])
    local.add_dir(DRAFT, tiny_pair[1])
    server, thread = serve(local)
    yield local
    stop(server, thread)


def _chat(hub: LocalHub, home: Path, *extra: str) -> str:
    """One chat session: ask once, leave with Ctrl-D; returns the screen text."""
    pexpect = pytest.importorskip("pexpect")
    env = {**os.environ, "HOME": str(home), "HF_HOME": str(home / "hf"), "SPECEXEC_CACHE": str(home / "specexec"),
           "HF_ENDPOINT": hub.url, "TERM": "xterm-256color", "NO_COLOR": "1", "COLUMNS": "120",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_HUB_CACHE", "XDG_CACHE_HOME"):
        env.pop(name, None)
    child = pexpect.spawn(sys.executable, ["-m", "cli.main", "chat", "--model", TARGET, "--draft", DRAFT,
                                           "--ram-budget", "8GB", "--offload", "ssd", "--max-new-tokens", "8",
                                           "--budget", "8", *extra],
                          cwd=str(ROOT), env=env, encoding="utf-8", timeout=180, dimensions=(50, 120))
    chunks: list[str] = []
    child.logfile_read = type("Log", (), {"write": lambda _s, x: chunks.append(x), "flush": lambda _s: None})()
    try:
        child.expect(">>> ")
        child.sendline("Hello")
        child.expect(r"tokens/pass")
        child.expect(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, screen_text("".join(chunks))
    return screen_text("".join(chunks))


@pytest.mark.slow
def test_first_chat_downloads_plans_converts_then_prompts(hub: LocalHub, tiny_pair, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    screen = _chat(hub, home)
    total = sum((tiny_pair[0] / n).stat().st_size for n in LOADED) / 1000
    steps = [rf"downloaded {TARGET} .* {total:.1f}/{total:.1f} kB .*eta",
             rf"downloaded {DRAFT} .* kB .*eta",
             rf"memory ledger: target 4 layers {FORMAT}",                    # the plan before any conversion
             r"offload plan \(ssd, 4 target layers",
             r"SSD tier +4 layers",
             rf"quantizing to {FORMAT} .* 4/4 layers [\d.]+ MB/s \d:\d\d:\d\d ETA \d:\d\d:\d\d",  # MB/s of input, elapsed, then the ETA
             r"^>>> Hello"]
    at = []
    for step in steps:
        found = re.search(step, screen, re.M)
        assert found, f"{step!r} not on the screen:\n{screen}"
        at.append(found.start())
    assert at == sorted(at), f"out of order:\n{screen}"
    assert re.search(r"^\d+ tokens · .* tokens/pass", screen, re.M)
    print(screen)                                          # the capture, with pytest -s

    hub.log.clear()
    again = _chat(hub, home, "--offline")
    assert not hub.log                                     # nothing asked of the Hub
    assert not re.search(r"download(ing|ed) tiny-org/", again) and "quantizing" not in again
    assert re.search(r"offload plan \(ssd, 4 target layers", again) and ">>> Hello" in again
