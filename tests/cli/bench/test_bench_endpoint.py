"""`specexec bench --endpoint URL`: the benchmark as a client of an OpenAI-compatible server, measured against our
own `specexec serve` on 127.0.0.1 (tests/serving/test_serve.py's in-process uvicorn). The token counts equal what the
server generates for the same requests, the server is found without --model, two endpoints make two rows of one
table, and a refused key, a closed port or a flag that means nothing remotely are one line (exit 2)."""
from __future__ import annotations

import json
import socket

import pytest

pytest.importorskip("uvicorn")                     # the serve extra: absent (e.g. on a lent GPU image), skip
pytest.importorskip("starlette")

from cli.main import main  # noqa: E402
from cli.serve.app import ServeSettings, build_app  # noqa: E402
from specexec.config import EngineConfig, SamplingParams  # noqa: E402
from specexec.serving.openai_api import ServerDefaults  # noqa: E402
from specexec.prompts import load_prompts  # noqa: E402
from specexec.runtime.assembly import Runtime  # noqa: E402
from tests.serving.live_server import running  # noqa: E402

MODEL, KEY, LIMIT, MAX_NEW = "tiny-pair", "sekret", 3, 8


@pytest.fixture(scope="module")
def runtime(tiny_pair, tiny_perturbed_draft) -> Runtime:
    return Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), EngineConfig(budget=8, dtype="float32"))


@pytest.fixture(scope="module")
def url(runtime):
    with running(build_app(runtime, ServerDefaults(MODEL, SamplingParams(), 32))) as base:
        yield base


@pytest.fixture(scope="module")
def keyed_url(runtime):
    with running(build_app(runtime, ServerDefaults(MODEL, SamplingParams(), 32), ServeSettings(api_key=KEY))) as base:
        yield base


def _bench(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["bench", *argv, "--limit", str(LIMIT), "--max-new-tokens", str(MAX_NEW), "--warmup", "0"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_endpoint_rows_count_what_the_server_generated(capsys, url) -> None:
    code, out, err = _bench(capsys, "--endpoint", url, "--json")
    assert code == 0, err
    (row,) = json.loads(out)["rows"]
    assert row["config"] == f"endpoint {MODEL} @ {url}/v1"                  # found through GET /v1/models
    assert row["tok_s"] > 0 and row["ttft_s"] > 0 and row["tokens_per_pass"] is None
    openai = pytest.importorskip("openai")

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    expected = 0
    for p in load_prompts()[:LIMIT]:                  # the same prompts, not streamed: the server's own count
        messages = ([{"role": "system", "content": p.system}] if p.system else []) + \
            [{"role": "user", "content": p.prompt}]
        done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_NEW, temperature=0)
        expected += done.usage.completion_tokens
    assert row["new_tokens"] == expected
    assert "endpoint tiny-pair" in err                                        # the table (stderr with --json)


def test_two_endpoints_one_table_and_the_api_key(capsys, url, keyed_url) -> None:
    code, out, err = _bench(capsys, "--endpoint", url, "--endpoint", keyed_url, "--model", MODEL, "--json")
    assert code == 2 and err.count("\n") == 1 and "HTTP 401" in err
    code, out, err = _bench(capsys, "--endpoint", url, "--endpoint", keyed_url, "--model", MODEL,
                            "--api-key", KEY, "--json", "--raw")
    assert code == 0, err
    rows = json.loads(out)["rows"]
    assert [r["config"] for r in rows] == [f"endpoint {MODEL} @ {url}/v1", f"endpoint {MODEL} @ {keyed_url}/v1"]
    assert rows[0]["new_tokens"] == rows[1]["new_tokens"] > 0                 # same server, greedy


def test_endpoint_failures_are_one_line(capsys, url) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    for argv, message in ((["--endpoint", closed], "cannot reach"),
                          (["--endpoint", "localhost:8000"], "give an http:// or https:// URL"),
                          (["--endpoint", url, "--budgets", "4,8"], "--budgets does not apply with --endpoint")):
        code, _, err = _bench(capsys, *argv)
        assert code == 2 and err.count("\n") == 1 and message in err, err
