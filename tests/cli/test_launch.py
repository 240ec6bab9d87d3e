"""`specexec launch AGENT` (cli/launch.py) with a stand-in agent: a program that reads the environment (and the
arguments) each agent is given, makes one request with the openai SDK and one with the anthropic SDK, writes
what it saw, and exits with a code launch passes on. Against a running server (--url, and one found on
--port), and (slow) with a server launch starts from serve flags and stops when the agent exits; a missing agent
is one line."""
from __future__ import annotations

import json
import os
import socket
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("anthropic")

from cli.launch import split_rest  # noqa: E402
from cli.main import main  # noqa: E402
from tests.serving.tool_models import load_tool_runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = textwrap.dedent('''
    import json, os, sys
    import anthropic, openai
    env, argv = os.environ, sys.argv[1:]
    model, key = env["SPECEXEC_MODEL"], env["SPECEXEC_API_KEY"]
    if "ANTHROPIC_BASE_URL" in env:                          # claude
        base, akey, model = env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_AUTH_TOKEN"], env["ANTHROPIC_MODEL"]
        obase, okey = env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"]
    elif "OPENCODE_CONFIG_CONTENT" in env:                   # opencode: its provider's options
        config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
        assert json.load(open(env["OPENCODE_CONFIG"])) == config
        options = config["provider"]["specexec"]["options"]
        obase, okey, model = options["baseURL"], options["apiKey"], config["model"].split("/", 1)[1]
        base, akey = obase.removesuffix("/v1"), okey
    else:                                                    # codex: -c provider settings, -m model
        settings = dict(a.split("=", 1) for a in argv[1:argv.index("-m"):2])
        obase = json.loads(settings["model_providers.specexec.base_url"])
        okey = env[json.loads(settings["model_providers.specexec.env_key"])]
        model = argv[argv.index("-m") + 1]
        base, akey = obase.removesuffix("/v1"), okey
    o = openai.OpenAI(base_url=obase, api_key=okey, max_retries=0, timeout=60)
    r = o.chat.completions.create(model=model, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    a = anthropic.Anthropic(base_url=base, auth_token=akey, max_retries=0, timeout=60)
    m = a.messages.create(model=model, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    json.dump({"openai": r.usage.completion_tokens, "anthropic": m.usage.output_tokens, "model": model,
               "argv": argv}, open(env["STAND_IN_OUT"], "w"))
    sys.exit(int(env.get("STAND_IN_EXIT", "0")))
''')


@pytest.fixture(scope="module")
def tool_runtime(tiny_pair, tiny_perturbed_draft, tiny_root):
    """The tiny pair with a chat template (tests/serving's)."""
    return load_tool_runtime(tiny_root, tiny_pair[0], tiny_perturbed_draft)


@pytest.fixture
def stand_in(tmp_path, monkeypatch) -> tuple[str, Path]:
    script = tmp_path / "agent.py"
    script.write_text(STAND_IN)
    out = tmp_path / "seen.json"
    monkeypatch.setenv("STAND_IN_OUT", str(out))
    monkeypatch.setenv("STAND_IN_EXIT", "3")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    return f"{sys.executable} {script}", out


def test_the_words_after_the_agent_split_into_launch_serve_and_agent_flags() -> None:
    assert split_rest(["--model", "m", "--url=http://h:1", "--agent-command", "x y", "--port", "9", "--", "-p"]) \
        == ({"url": "http://h:1", "agent_command": "x y"}, ["--model", "m", "--port", "9"], ["-p"])


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode"])
def test_each_agent_reaches_a_running_server_with_both_sdks(agent, stand_in, tool_runtime) -> None:
    from cli.serve.app import ServeSettings, build_app
    from specexec.config import SamplingParams
    from specexec.serving.openai_api import ServerDefaults
    from tests.serving.live_server import running

    command, out = stand_in
    app = build_app(tool_runtime, ServerDefaults("tiny-agent", SamplingParams(), 4), ServeSettings(api_key="k"))
    with running(app) as base:
        code = main(["launch", agent, "--url", base + "/v1", "--api-key", "k", "--agent-command", command,
                     "--", "--print", "hello"])
    seen = json.loads(out.read_text())
    assert code == 3 and seen["openai"] >= 1 and seen["anthropic"] >= 1 and seen["model"] == "tiny-agent"
    assert seen["argv"][-2:] == ["--print", "hello"]


def test_a_server_already_on_the_port_is_used(stand_in, tool_runtime, capsys) -> None:
    from cli.serve.app import build_app
    from specexec.config import SamplingParams
    from specexec.serving.openai_api import ServerDefaults
    from tests.serving.live_server import running

    command, out = stand_in
    with running(build_app(tool_runtime, ServerDefaults("tiny-found", SamplingParams(), 4))) as base:
        port = base.rsplit(":", 1)[1]
        assert main(["launch", "claude", "--port", port, "--agent-command", command]) == 3
    assert json.loads(out.read_text())["model"] == "tiny-found"
    assert "starting" not in capsys.readouterr().err


def test_a_missing_agent_is_one_line(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["launch", "codex", "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "codex is not installed" in err[0] and "--agent-command" in err[0], err


@pytest.mark.slow
def test_a_started_server_serves_the_agent_and_stops_with_it(stand_in, tiny_pair, monkeypatch, capsys) -> None:
    command, out = stand_in
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["launch", "claude", "--agent-command", command, "--model", str(tiny_pair[0]), "--no-draft",
                 "--max-new-tokens", "4", "--served-model-name", "tiny-started", "--port", str(_free_port())])
    seen = json.loads(out.read_text())
    assert code == 3 and seen["model"] == "tiny-started" and seen["openai"] >= 1 and seen["anthropic"] >= 1
    err = capsys.readouterr().err
    url = err.split("launch: claude on ", 1)[1].split()[0]
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as s:                                  # the server it started is gone
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert os.environ.get("SPECEXEC_API_KEY") is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
