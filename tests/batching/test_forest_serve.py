"""`serve` with several requests running at once (--parallel): concurrent clients through the openai client get
exactly their solo completions, their trees share the target's passes (/metrics: running, queued, forest size),
requests over --parallel queue, and a client that disconnects mid-stream frees its place at the next step."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from cli.serve.app import ServeSettings, build_app  # noqa: E402
from specexec.batching.pool import SeatPool, seating  # noqa: E402
from specexec.config import EngineConfig, SamplingParams  # noqa: E402
from specexec.options import ConfigError  # noqa: E402
from specexec.runtime.assembly import Runtime  # noqa: E402
from specexec.serving.openai_api import ServerDefaults  # noqa: E402
from tests.serving.live_server import connect, raw, running, send  # noqa: E402

MODEL, MAX_TOKENS = "tiny-pair", 24
PROMPTS = ["Hello", "The quick brown fox jumps", "Once upon a time there was", "def main():"]


@pytest.fixture(scope="module")
def runtime(tiny_pair: tuple[Path, Path], tiny_perturbed_draft: Path) -> Runtime:
    return Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft),
                        EngineConfig(budget=8, dtype="float32", max_new_tokens=MAX_TOKENS))


def _app(runtime: Runtime, parallel: int):
    return build_app(runtime, ServerDefaults(MODEL, SamplingParams(), MAX_TOKENS), ServeSettings(parallel=parallel))


def _complete(url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens).choices[0].text
    finally:
        client.close()


def _metrics(url: str) -> dict:
    return raw(url, "GET", "/metrics?format=json")[1]


def test_concurrent_clients_get_their_solo_completions_from_shared_passes(runtime: Runtime) -> None:
    with running(_app(runtime, 1)) as url:
        solo = {p: _complete(url, p) for p in PROMPTS}
    with running(_app(runtime, 2)) as url:
        got, seen = {}, {"running": 0, "queued": 0}
        threads = [threading.Thread(target=lambda p=p: got.__setitem__(p, _complete(url, p))) for p in PROMPTS]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            m = _metrics(url)
            seen = {"running": max(seen["running"], m["running"]), "queued": max(seen["queued"], m["queue_depth"])}
            time.sleep(0.01)
        m = _metrics(url)
        text = raw(url, "GET", "/metrics")[1]
    assert got == solo                                       # every completion is its solo run's
    assert seen["running"] <= 2 and m["parallel"] == 2 and m["running"] == 0
    assert m["jobs_completed"] == len(PROMPTS) and m["forest_size_mean"] > 1   # passes carried two requests
    assert "specexec_forest_size_mean" in text and "specexec_running 0" in text


def test_a_disconnect_mid_stream_frees_its_place(runtime: Runtime) -> None:
    with running(_app(runtime, 1)) as url:
        solo = _complete(url, PROMPTS[1], 64)
    with running(_app(runtime, 2)) as url:
        conn = connect(url)
        resp = send(conn, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400,
                                                      "stream": True, "ignore_eos": True})
        assert resp.status == 200
        while b'"text":"' not in resp.readline():
            pass
        other: dict = {}
        worker = threading.Thread(target=lambda: other.__setitem__("text", _complete(url, PROMPTS[1], 64)))
        worker.start()
        conn.close()                                          # the first client goes away mid-stream
        worker.join(120)
        deadline = time.monotonic() + 30
        while (m := _metrics(url))["jobs_cancelled"] < 1 or m["running"]:
            assert time.monotonic() < deadline, "the abandoned request kept its place"
            time.sleep(0.02)
        assert m["generated_tokens"] < 400 + 64
    assert other["text"] == solo


def test_seating_names_per_request_bytes_and_refuses_more_than_fit(runtime: Runtime) -> None:
    seats = seating(runtime, None)
    assert seats.parallel == min(4, seats.fits) and seats.target_kv > 0 and seats.draft_kv > 0
    assert "requests share each pass" in seats.line() and "target KV" in seats.line()
    with pytest.raises(ConfigError, match=r"--parallel \d+: only \d+ requests' caches fit"):
        seating(runtime, seats.fits + 1)
    assert SeatPool.why_not(runtime) is None


def test_n_choices_run_as_sibling_requests_with_their_solo_outputs(runtime: Runtime) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 16, "n": 3, "temperature": 0.9, "seed": 11}
    with running(_app(runtime, 1)) as url:
        solo = raw(url, "POST", "/v1/completions", body)[1]
    with running(_app(runtime, 3)) as url:
        got = raw(url, "POST", "/v1/completions", body)[1]
        streamed = raw(url, "POST", "/v1/completions", {**body, "stream": True})[1]
        m = _metrics(url)
    texts = [c["text"] for c in sorted(solo["choices"], key=lambda c: c["index"])]
    assert len(set(texts)) > 1                                      # the seeded choices differ
    assert [c["text"] for c in sorted(got["choices"], key=lambda c: c["index"])] == texts
    assert m["jobs_started"] == 2 and m["jobs_completed"] == 2 and m["forest_size_mean"] > 1
    pieces = {i: "" for i in range(3)}
    for line in streamed.splitlines():
        if line.startswith("data: {"):
            import json
            for c in json.loads(line[6:])["choices"]:
                pieces[c["index"]] += c["text"]
    assert [pieces[i] for i in range(3)] == texts
