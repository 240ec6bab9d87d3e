"""`specexec serve` over loopback with the tiny models, driven by the official `openai` client (and http.client
for raw requests): chat and text completions, streaming, n > 1, seeds, stop strings, FIFO under concurrent
clients, client disconnects that free the queue, KV-prefix reuse across turns, OpenAI-style 4xx bodies for
malformed requests, the API key, /metrics, greedy output identical to `specexec generate --json`, and the command itself
in a subprocess. Every server binds 127.0.0.1 on a free port and is stopped at the end of its module/test."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("uvicorn")           # the serve extra: absent (e.g. on a lent GPU image), skip
pytest.importorskip("starlette")

from cli.main import main  # noqa: E402
from cli.serve.app import ServeSettings, build_app  # noqa: E402
from tests.serving.live_server import connect, raw, running, send  # noqa: E402
from specexec.config import EngineConfig, SamplingParams  # noqa: E402
from specexec.serving.openai_api import ServerDefaults  # noqa: E402
from specexec.runtime.assembly import Runtime  # noqa: E402
from specexec.runtime.detokenizer import Detokenizer  # noqa: E402

if TYPE_CHECKING:
    import openai          # imported by the tests that use it: collecting this file stays cheap

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-pair"
BUDGET, MAX_TOKENS = 8, 32
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def runtime(tiny_pair, tiny_perturbed_draft) -> Runtime:
    return Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft),
                        EngineConfig(budget=BUDGET, dtype="float32", max_new_tokens=MAX_TOKENS))


@pytest.fixture(scope="module")
def url(runtime) -> Iterator[str]:
    app = build_app(runtime, ServerDefaults(MODEL, SamplingParams(), MAX_TOKENS), ServeSettings(max_body=MAX_BODY))
    with running(app) as base:
        yield base


@pytest.fixture
def client(url) -> openai.OpenAI:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, content: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def metrics(url: str) -> dict:
    return raw(url, "GET", "/metrics?format=json")[1]


def health(url: str) -> dict:
    return raw(url, "GET", "/health")[1]


def cli_generate(capsys, tiny_pair, draft, *argv: str) -> dict:
    """`specexec generate --json` in-process with the server's model, draft, budget and dtype."""
    code = main(["generate", "--model", str(tiny_pair[0]), "--draft", str(draft), "--budget", str(BUDGET),
                 "--dtype", "float32", *argv, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


# ------------------------------------------------------------------------------------------ endpoints

def test_models_health_and_metrics(client, url) -> None:
    openai = pytest.importorskip("openai")
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as e:                # a model this server does not serve
        client.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert client.models.retrieve(MODEL).owned_by == "specexec"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    state = health(url)
    assert state["status"] == "ok" and state["model"] == MODEL and state["queue_depth"] == 0
    chat(client, "Hello", max_tokens=8)
    text = raw(url, "GET", "/metrics")[1]
    for name in ("specexec_queue_depth 0", "specexec_tokens_per_step ", "specexec_tokens_per_second ",
                 "specexec_generated_tokens_total ", 'specexec_jobs_total{outcome="completed"}',
                 "specexec_queue_wait_seconds_total ", "specexec_jobs_started_total ", "specexec_last_queue_ms ",
                 'specexec_requests_total{path="/v1/chat/completions",status="200"}'):
        assert name in text, text
    snap = metrics(url)
    assert snap["generated_tokens"] >= 1 and snap["steps"] >= 1 and snap["tokens_per_step"] >= 1


def test_chat_completion(client) -> None:
    r = chat(client, "Hello", max_tokens=16, frequency_penalty=0, presence_penalty=0, user="u1", logprobs=False,
             extra_body={"some_future_field": True})
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 16 and r.usage.prompt_tokens > 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    ext = r.model_extra["specexec"]
    assert ext["builder"] == "specexec" and ext["budget"] == BUDGET and ext["steps"] >= 1
    assert ext["tokens_per_step"] == pytest.approx(r.usage.completion_tokens / ext["steps"], abs=1e-3)
    assert ext["choices"][0]["tree_size"] > 0


def test_stream_arrives_in_chunks_before_the_end(client, url) -> None:
    whole = chat(client, "Hello", max_tokens=48).choices[0].message.content
    stream = chat(client, "Hello", max_tokens=48, stream=True, stream_options={"include_usage": True})
    parts, busy_at_first, finish, usage = [], None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            if not parts:
                busy_at_first = health(url)["busy"]
            parts.append(delta.content)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == whole
    assert len(parts) >= 3 and busy_at_first is True      # text came while the engine was still generating
    assert finish in ("stop", "length")
    assert usage.choices == [] and usage.usage.completion_tokens >= len(parts)
    assert usage.model_extra["specexec"]["steps"] >= 1


def test_completions_n2_seed_and_echo(client) -> None:
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, n=2, temperature=1.0, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.object == "text_completion" and [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]        # same seed, same samples
    assert 2 <= a.usage.completion_tokens <= 24 and a.usage.prompt_tokens == b.usage.prompt_tokens
    assert len(a.model_extra["specexec"]["choices"]) == 2
    others = {tuple(c.text for c in client.completions.create(**{**kw, "seed": s}).choices) for s in (1, 2, 3)}
    assert len(others | {tuple(c.text for c in a.choices)}) > 1               # the seed matters
    echoed = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, echo=True)
    assert echoed.choices[0].text.startswith("Once upon a time")
    chat_n = chat(client, "Hello", max_tokens=8, n=2)
    assert [c.index for c in chat_n.choices] == [0, 1]
    assert chat_n.choices[0].message.content == chat_n.choices[1].message.content    # greedy: identical


def test_prompt_forms(client, runtime) -> None:
    ids = runtime.encode("The quick brown fox")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8)
    by_text = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=["The quick brown fox", "Hello"], max_tokens=8)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == by_text.choices[0].text


def test_stop_strings_match_cli(client, capsys, tiny_pair, tiny_perturbed_draft) -> None:
    full = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24).choices[0].text
    stop = next(full[i:i + 2] for i in range(4, len(full) - 2) if full[i:i + 2].strip() and full[i:i + 2].isprintable())
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, stop=[stop, "@@@"])
    text = r.choices[0].text
    assert stop not in text and full.startswith(text) and r.choices[0].finish_reason == "stop"
    cli = cli_generate(capsys, tiny_pair, tiny_perturbed_draft, "--prompt", "The quick brown fox",
                       "--max-new-tokens", "24", "--stop", stop, "@@@")
    assert text == cli["text"]
    streamed = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text


def cut_before_first(text: str, stops: list[str]) -> str:
    hits = [text.find(s) for s in stops if s in text]
    return text[:min(hits)] if hits else text


def mid_token_stops(runtime, prompt_ids: list[int], n: int, sampling: SamplingParams) -> tuple[str, str]:
    """Two stop strings of this output: one that begins inside a token of two or more characters, one that
    spans a token boundary."""
    ids = [t for new, _ in runtime.generate_text(prompt_ids, n, sampling) for t in new]
    detok = Detokenizer(runtime.tokenizer, prompt_ids)
    full = detok.text(ids)
    ends = [len(detok.text(ids[:k])) for k in range(len(ids) + 1)]
    mid = next(ends[k] + 1 for k in range(len(ids)) if ends[k + 1] - ends[k] >= 2 and full[ends[k] + 1:].strip())
    span = next(e - 1 for e in ends[1:-1] if full[e - 1:e + 1].strip() and e > mid + 2)
    return full[mid:mid + 2], full[span:span + 3]


def test_stop_strings_keep_the_text_before_them_in_the_same_token(client, runtime) -> None:
    """OpenAI's contract over loopback through the official client: the text up to the first stop string,
    wherever token boundaries fall (a stop beginning mid-token keeps that token's text before it), for text and
    chat completions, streamed and not, n = 2 (each choice cut at its own first stop), and the prompt's echo
    (a stop string in the prompt does not cut it)."""
    prompt = "The quick brown fox"
    kw = dict(model=MODEL, max_tokens=24, temperature=0)
    full = client.completions.create(prompt=prompt, **kw).choices[0].text
    stops = list(mid_token_stops(runtime, runtime.encode(prompt), 24, SamplingParams()))
    for stop in ([stops[0]], [stops[1]], ["@@@", *stops]):
        want = cut_before_first(full, stop)
        assert len(want) < len(full)
        assert client.completions.create(prompt=prompt, stop=stop, **kw).choices[0].text == want, stop
        streamed = client.completions.create(prompt=prompt, stop=stop, stream=True, **kw)
        assert "".join(c.choices[0].text for c in streamed) == want
    echoed = client.completions.create(prompt=prompt, stop=["quick", stops[0]], echo=True, **kw)
    assert echoed.choices[0].text == prompt + cut_before_first(full, ["quick", stops[0]])

    kw = dict(max_tokens=24, temperature=0)
    chat_full = chat(client, "Hello", **kw).choices[0].message.content
    chat_stops = list(mid_token_stops(runtime, runtime.encode("Hello", chat=True), 24, SamplingParams()))
    want = cut_before_first(chat_full, chat_stops)
    assert len(want) < len(chat_full)
    assert chat(client, "Hello", stop=chat_stops, **kw).choices[0].message.content == want
    pieces = chat(client, "Hello", stop=chat_stops, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == want

    sampled = dict(model=MODEL, max_tokens=24, temperature=1.0, seed=77, n=2)
    fulls = [c.text for c in sorted(client.completions.create(prompt=prompt, **sampled).choices,
                                    key=lambda c: c.index)]
    both = [mid_token_stops(runtime, runtime.encode(prompt), 24, SamplingParams(temperature=1.0, seed=77 + i))[0]
            for i in range(2)]
    got = sorted(client.completions.create(prompt=prompt, stop=both, **sampled).choices, key=lambda c: c.index)
    assert [c.text for c in got] == [cut_before_first(f, both) for f in fulls]


def test_greedy_over_http_equals_cli_generate(client, capsys, tiny_pair, tiny_perturbed_draft) -> None:
    prompt = "The quick brown fox"
    cli = cli_generate(capsys, tiny_pair, tiny_perturbed_draft, "--prompt", prompt, "--max-new-tokens", "24")
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == cli["text"] and r.usage.completion_tokens == len(cli["token_ids"])
    cli_chat = cli_generate(capsys, tiny_pair, tiny_perturbed_draft, "--prompt", "Hello", "--chat",
                            "--max-new-tokens", "24")
    c = chat(client, "Hello", max_tokens=24, temperature=0)
    assert c.choices[0].message.content == cli_chat["text"]
    assert c.usage.completion_tokens == len(cli_chat["token_ids"])


def test_presence_and_frequency_penalties_match_cli_generate(client, url, capsys, tiny_pair,
                                                              tiny_perturbed_draft) -> None:
    """Non-zero OpenAI penalties are applied (exactly, per tree node), the same over HTTP as in the CLI."""
    prompt, kw = "The quick brown fox", dict(model=MODEL, max_tokens=32, temperature=0)
    plain = client.completions.create(prompt=prompt, **kw).choices[0].text
    r = client.completions.create(prompt=prompt, frequency_penalty=1.5, presence_penalty=0.5, **kw)
    cli = cli_generate(capsys, tiny_pair, tiny_perturbed_draft, "--prompt", prompt, "--max-new-tokens", "32",
                       "--frequency-penalty", "1.5", "--presence-penalty", "0.5")
    assert r.choices[0].text == cli["text"] and r.usage.completion_tokens == len(cli["token_ids"])
    assert r.choices[0].text != plain                                # the penalty changes this greedy answer
    c = chat(client, "Hello", max_tokens=8, frequency_penalty=-0.5, presence_penalty=2)
    assert c.choices[0].finish_reason in ("stop", "length")
    code, reply = raw(url, "POST", "/v1/completions", {"model": MODEL, "prompt": prompt, "frequency_penalty": 3.0})
    assert code == 400 and reply["error"]["param"] == "frequency_penalty", reply
    assert reply["error"]["code"] == "invalid_value" and "[-2.0, 2.0]" in reply["error"]["message"]


def test_second_turn_reuses_the_kv_prefix(client) -> None:
    first = [{"role": "user", "content": "Hello, how are you today?"}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=12)
    history = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                       {"role": "user", "content": "Tell me a story."}]
    r2 = client.chat.completions.create(model=MODEL, messages=history, max_tokens=12)
    reused = r2.model_extra["specexec"]["reused_tokens"]
    assert reused >= r1.usage.prompt_tokens - 1, (reused, r1.usage.prompt_tokens)
    assert reused < r2.usage.prompt_tokens


# ------------------------------------------------------------------------------------------ the queue

def test_concurrent_clients_are_served_fifo_and_unmixed(client, url) -> None:
    openai = pytest.importorskip("openai")
    prompts = ["Hello", "The quick brown fox", "Once upon a time", "What is the capital", "def main():",
               "A draft model"]
    expected = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=16).choices[0].text
                for p in prompts}
    got, finished, lock = {}, [], threading.Lock()
    clients = {p: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) for p in prompts}

    def ask(p: str) -> None:
        text = clients[p].completions.create(model=MODEL, prompt=p, max_tokens=16).choices[0].text
        with lock:
            got[p] = text
            finished.append(p)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    submitted = metrics(url)["jobs_submitted"]
    for t in threads:                    # arrival order = list order: each starts once the previous is queued
        t.start()
        submitted += 1
        deadline = time.monotonic() + 10
        while metrics(url)["jobs_submitted"] < submitted:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    for t in threads:
        t.join(60)
    assert got == expected
    assert finished == prompts


class Hold:
    """Once armed, every generation pauses after its first step until some client gives up (a ticket is
    cancelled: a disconnect, or a waiting request leaving): a job then outlasts any client timeout and the
    cancel reaches it mid-job, however fast the machine; nothing waits on a clock."""

    def __init__(self) -> None:
        self.armed, self.gave_up = False, threading.Event()

    def arm(self) -> None:
        self.gave_up.clear()
        self.armed = True


@pytest.fixture
def hold(runtime, monkeypatch: pytest.MonkeyPatch) -> Hold:
    from specexec.serving import queue

    h, cancel, generate = Hold(), queue.Ticket.cancel, runtime.generate_ids

    def cancel_and_tell(ticket) -> None:
        cancel(ticket)
        if h.armed:
            h.gave_up.set()

    def held(*args, **kwargs):
        steps = generate(*args, **kwargs)
        try:
            for k, step in enumerate(steps):
                yield step
                if k == 0 and h.armed and not h.gave_up.wait(60):
                    raise AssertionError("a held job waited 60 s and no client gave up")
        finally:
            steps.close()

    monkeypatch.setattr(queue.Ticket, "cancel", cancel_and_tell)
    monkeypatch.setattr(runtime, "generate_ids", held)
    return h


def _long_job(max_tokens: int = 64) -> dict:
    """A request that keeps the worker busy for 16 greedy choices (held by `hold` where a test needs it
    to outlast a client)."""
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": max_tokens, "n": 16}


def _let_go(client, url: str, tokens_before: int, one: int) -> None:
    """The worker let go of the abandoned job (16 greedy choices of `one` tokens each) before its end: it
    generated fewer tokens than the job would have, nothing waits, and the next request is answered."""
    assert metrics(url)["generated_tokens"] - tokens_before < 16 * one, "the abandoned generation ran to its end"
    assert health(url)["queue_depth"] == 0
    r = chat(client, "Hello", max_tokens=4)
    assert r.choices[0].message.content is not None


def _wait_submitted(url: str, count: int) -> None:
    deadline = time.monotonic() + 10
    while metrics(url)["jobs_submitted"] < count:
        assert time.monotonic() < deadline, "the request was not submitted"
        time.sleep(0.005)


def _wait_cancelled(url: str, before: int) -> None:
    deadline = time.monotonic() + 10
    while metrics(url)["jobs_cancelled"] <= before:
        assert time.monotonic() < deadline, "the abandoned job was not cancelled"
        time.sleep(0.02)


def _give_up_after(url: str, seconds: float) -> None:
    """Send a long non-streamed request, wait `seconds` for the answer, then close the connection."""
    conn = connect(url, timeout=seconds)
    try:
        with pytest.raises(TimeoutError):
            send(conn, "POST", "/v1/chat/completions", _long_job())
    finally:
        conn.close()


def test_stream_disconnect_frees_the_queue(client, url, hold: Hold) -> None:
    one = chat(client, "Hello", max_tokens=64).usage.completion_tokens   # one choice; the long job has 16
    snap = metrics(url)
    before, tokens = snap["jobs_cancelled"], snap["generated_tokens"]
    hold.arm()                                              # the job pauses after its first step until we go
    conn = connect(url)
    try:
        resp = send(conn, "POST", "/v1/chat/completions", {**_long_job(), "stream": True})
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
        line = b""
        while b'"content":"' not in line or b'"content":""' in line:
            line = resp.readline()
            assert line, "the stream ended before any text"
        assert line.startswith(b"data: ")                   # generation is under way; now hang up
    finally:
        conn.close()
    _wait_cancelled(url, before)
    _let_go(client, url, tokens, one)
    assert health(url)["queue_depth"] == 0


def test_non_streamed_disconnect_frees_the_queue(client, url, hold: Hold) -> None:
    one = chat(client, "Hello", max_tokens=64).usage.completion_tokens
    snap = metrics(url)
    before, tokens = snap["jobs_cancelled"], snap["generated_tokens"]
    hold.arm()                                      # no answer can come before the client gives up
    _give_up_after(url, 0.5)
    _wait_cancelled(url, before)
    _let_go(client, url, tokens, one)


def test_waiting_request_that_disconnects_leaves_the_queue(client, url, hold: Hold) -> None:
    before, started = metrics(url)["jobs_submitted"], metrics(url)["jobs_cancelled"]
    done = threading.Event()
    hold.arm()                                      # `long` runs until the waiting request has given up

    def long() -> None:
        status, body = raw(url, "POST", "/v1/chat/completions", _long_job(24), timeout=60)
        if status == 200 and len(body["choices"]) == 16:
            done.set()

    holder = threading.Thread(target=long)
    holder.start()
    _wait_submitted(url, before + 1)
    _give_up_after(url, 0.3)                        # queued behind `long`, gives up while waiting
    _wait_cancelled(url, started)
    assert health(url)["queue_depth"] == 0
    holder.join(60)
    assert done.is_set()


def test_a_failing_generation_is_a_500_body_and_the_server_lives_on(client, url, runtime, monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise RuntimeError("simulated engine failure")
        yield                                                     # a generator, like the real one

    monkeypatch.setattr(runtime, "generate_text", boom)
    code, reply = raw(url, "POST", "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4})
    assert code == 500 and reply["error"]["type"] == "server_error", reply
    assert "simulated engine failure" in reply["error"]["message"]
    code, text = raw(url, "POST", "/v1/completions", {"model": MODEL, "prompt": "Hello", "stream": True})
    assert code == 200 and "simulated engine failure" in text and text.endswith("data: [DONE]\n\n"), text
    monkeypatch.undo()
    assert chat(client, "Hello", max_tokens=4).usage.completion_tokens >= 1
    assert metrics(url)["jobs_failed"] == 2


# ------------------------------------------------------------------------------------------ bad requests

BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b"\xff\xfe", 400, None),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"temperature": -1}, 400, "temperature"),
    ({"temperature": 1e400}, 400, "temperature"),    # json reads it as inf
    ({"top_p": 0}, 400, "top_p"),
    ({"top_k": 2.5}, 400, "top_k"),
    ({"seed": -3}, 400, "seed"),
    ({"n": 0}, 400, "n"),
    ({"n": True}, 400, "n"),
    ({"max_tokens": "ten"}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 100000}, 400, "messages"),
    ({"stop": 5}, 400, "stop"),
    ({"stream": "yes"}, 400, "stream"),
    ({"presence_penalty": 3.0}, 400, "presence_penalty"),
    ({"frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ({"frequency_penalty": "lots"}, 400, "frequency_penalty"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"logit_bias": {"abc": 10}}, 400, "logit_bias"),
    ({"logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"response_format": {"type": "yaml"}}, 400, "response_format"),
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", 400, None),                # past Python's integer digit limit
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),   # a lone surrogate
    (b"[" * 20_000 + b"]" * 20_000, 400, None),                                # deeper than Python's recursion
]


def test_access_log_one_line_per_request(runtime) -> None:
    lines: list[str] = []
    app = build_app(runtime, ServerDefaults(MODEL, SamplingParams(), 8), ServeSettings(access_log=lines.append))
    openai = pytest.importorskip("openai")
    with running(app) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6)
        parts = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=6, stream=True))
        raw(base, "GET", "/health")
    assert parts and len(lines) == 3, lines
    n = r.usage.completion_tokens
    assert re.fullmatch(rf"POST /v1/chat/completions 200 tokens={n} wait=\d+\.\d\ds \d+\.\d\ds queue=0", lines[0])
    assert lines[1].startswith(f"POST /v1/chat/completions 200 tokens={n} ")      # the stream's, at its end
    assert lines[2].startswith("GET /health 200 tokens=- ")


def test_malformed_requests_get_openai_error_bodies(url) -> None:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    for body, status, param in BAD:
        data = body if isinstance(body, bytes) else json.dumps({**base, **body}).encode()
        code, reply = raw(url, "POST", "/v1/chat/completions", data)
        assert code == status, (body, code, reply)
        err = reply["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
    assert health(url)["status"] == "ok"


def test_oversized_and_misrouted_requests(url, client) -> None:
    openai = pytest.importorskip("openai")
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 80         # > 512 tokens of context
    code, reply = raw(url, "POST", "/v1/completions", {"model": MODEL, "prompt": long_prompt})
    assert code == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    code, reply = raw(url, "POST", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 99999]})
    assert code == 400 and reply["error"]["param"] == "prompt", reply
    code, reply = raw(url, "POST", "/v1/completions", {"model": MODEL, "prompt": "x" * (MAX_BODY + 10)})
    assert code == 413 and reply["error"]["code"] == "request_too_large", reply
    code, reply = raw(url, "GET", "/v1/chat/completions")
    assert code == 405 and "error" in reply, reply
    code, reply = raw(url, "GET", "/v1/nothing")
    assert code == 404 and reply["error"]["code"] == "not_found", reply
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "Hello", temperature=-2)
    assert e.value.status_code == 400 and "temperature" in str(e.value)
    assert chat(client, "Hello", max_tokens=4).choices[0].message.content is not None


def test_metrics_count_routes_not_paths_and_escape_labels(runtime) -> None:
    """20 requests to odd paths, unauthorized ones included, add no series (one per route template and status),
    and whatever the path holds, every sample line of the Prometheus text parses."""
    app = build_app(runtime, ServerDefaults(MODEL, SamplingParams(), 8), ServeSettings(api_key="k"))
    key = {"Authorization": "Bearer k"}
    with running(app) as base:
        for i in range(20):
            raw(base, "GET", f"/v1/models/odd-{i}%22%7Bx%7D%5C", headers=key if i % 2 else None)
            raw(base, "GET", f"/nowhere/{i}")
        snap = raw(base, "GET", "/metrics?format=json", headers=key)[1]
        text = raw(base, "GET", "/metrics", headers=key)[1]
    paths = {r["path"] for r in snap["requests"]}
    assert paths <= {"/v1/models/{model_id:path}", "/metrics"}, paths
    assert {(r["path"], r["status"], r["count"]) for r in snap["requests"] if r["path"].startswith("/v1")} == {
        ("/v1/models/{model_id:path}", 401, 10), ("/v1/models/{model_id:path}", 404, 10)}
    sample = re.compile(r'^[a-z_]+(\{[a-z_]+="(?:[^"\\\n]|\\.)*"(?:,[a-z_]+="(?:[^"\\\n]|\\.)*")*\})? -?[\d.e+-]+$')
    for line in text.splitlines():
        assert line.startswith("#") or sample.match(line), line


def test_prompts_times_n_past_the_cap_is_a_400(runtime) -> None:
    app = build_app(runtime, ServerDefaults(MODEL, SamplingParams(), 8), ServeSettings(max_choices=6))
    with running(app) as base:
        code, reply = raw(base, "POST", "/v1/completions", {"model": MODEL, "prompt": ["a", "b", "c"], "n": 3,
                                                            "max_tokens": 2})
        assert code == 400 and reply["error"]["code"] == "too_many_choices", reply
        assert "3 prompt(s) x n 3 = 9 choices" in reply["error"]["message"] and "--max-choices" in reply["error"]["message"]
        code, reply = raw(base, "POST", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "n": 3,
                                                            "max_tokens": 2})
        assert code == 200 and len(reply["choices"]) == 6, reply


def test_api_key(runtime) -> None:
    openai = pytest.importorskip("openai")
    app = build_app(runtime, ServerDefaults(MODEL, SamplingParams(), 8), ServeSettings(api_key="s3cret"))
    with running(app) as base:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            code, reply = raw(base, "GET", "/v1/models", headers=headers)
            assert code == 401 and reply["error"]["code"] == "invalid_api_key", reply
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert chat(good, "Hello", max_tokens=4).usage.completion_tokens >= 1
        assert raw(base, "GET", "/health")[0] == 200                              # health stays open


def test_a_full_queue_answers_429(runtime, hold: Hold) -> None:
    app = build_app(runtime, ServerDefaults(MODEL, SamplingParams(), 8), ServeSettings(max_queue=1))
    hold.arm()                                     # the running job pauses until a holder hangs up
    with running(app) as base:
        def holder() -> None:                      # a long job that hangs up after 3 s (cancelled then)
            with contextlib.suppress(TimeoutError):
                raw(base, "POST", "/v1/chat/completions", _long_job(), timeout=3)

        holders = []
        for expected in (1, 2):                    # one running, one waiting: the queue of 1 is full
            holders.append(threading.Thread(target=holder))
            holders[-1].start()
            _wait_submitted(base, expected)
        code, reply = raw(base, "POST", "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert code == 429 and reply["error"]["code"] == "queue_full", reply
        for t in holders:
            t.join(30)


# ------------------------------------------------------------------------------------------ the command

def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_serve_command_end_to_end(tiny_pair, tiny_perturbed_draft) -> None:
    openai = pytest.importorskip("openai")
    cmd = [sys.executable, "-m", "cli.main", "serve", "--model", str(tiny_pair[0]), "--draft",
           str(tiny_perturbed_draft), "--budget", "8", "--port", "0", "--api-key", "k3y", "--max-new-tokens", "8",
           "--served-model-name", "tiny-served", "alias-a"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = None
        deadline = time.monotonic() + 120
        while base is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "serve exited early"
            m = re.search(r"serving (\S+) on (http://127\.0\.0\.1:\d+)/v1", line)
            if m:
                assert m.group(1) == "tiny-served"
                base = m.group(2)
        assert base is not None
        assert raw(base, "GET", "/v1/models")[0] == 401
        c = openai.OpenAI(base_url=base + "/v1", api_key="k3y", max_retries=0, timeout=60)
        r = c.completions.create(model="alias-a", prompt="Hello", max_tokens=5)    # an alias answers as the id
        assert r.usage.completion_tokens >= 1 and r.model == "tiny-served"
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model=tiny_pair[0].name, prompt="Hello", max_tokens=5)
        c.close()
        log = [proc.stderr.readline() for _ in range(3)]         # one access line per request, in order
        assert log[0].startswith("GET /v1/models 401 tokens=- ")
        assert log[1].startswith(f"POST /v1/completions 200 tokens={r.usage.completion_tokens} wait=")
        assert log[2].startswith("POST /v1/completions 404 ")
        proc.send_signal(signal.SIGINT)                        # Ctrl-C: a clean stop, the CLI's exit code
        assert proc.wait(30) == 130
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()


def test_without_the_serve_extra_the_error_says_what_to_install(capsys, monkeypatch, tiny_pair) -> None:
    for module in ("starlette", "uvicorn"):
        monkeypatch.setitem(sys.modules, module, None)          # `import starlette` now fails
    assert main(["serve", "--model", str(tiny_pair[0]), "--no-draft"]) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[serve]'" in err and "Traceback" not in err, err
    assert "needs starlette and uvicorn, which are not installed" in err, err          # grammar: one, or several
    monkeypatch.delitem(sys.modules, "uvicorn")
    assert main(["serve", "--model", str(tiny_pair[0]), "--no-draft"]) == 2
    assert "needs starlette, which is not installed" in capsys.readouterr().err


def test_the_core_package_does_not_import_the_http_stack() -> None:
    import ast

    for path in (ROOT / "specexec").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("starlette", "uvicorn", "fastapi") for n in names), path


def test_bad_port_is_one_line_error(capsys, tiny_pair) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        code = main(["serve", "--model", str(tiny_pair[0]), "--no-draft", "--port", str(busy.getsockname()[1])])
    finally:
        busy.close()
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: cannot listen on 127.0.0.1:"), err
