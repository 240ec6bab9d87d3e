"""A server under test: an ASGI app served by uvicorn on 127.0.0.1 (a free port) in a background thread, stopped
at the end, and plain HTTP requests to it (a helper of tests/serving/ and tests/cli/bench/test_bench_endpoint.py)."""
from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import uvicorn


@contextlib.contextmanager
def running(app) -> Iterator[str]:
    """Serve `app` on 127.0.0.1:<free port> in a background thread; yields the base URL; stops it after."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def connect(url: str, timeout: float = 30) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def send(conn: http.client.HTTPConnection, method: str, path: str, body: Any = None,
         headers: dict | None = None) -> http.client.HTTPResponse:
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    return conn.getresponse()


def raw(url: str, method: str, path: str, body: Any = None, headers: dict | None = None,
        timeout: float = 30) -> tuple[int, Any]:
    """(status, parsed JSON or text) of one plain HTTP request (stdlib only, loopback)."""
    conn = connect(url, timeout)
    try:
        resp = send(conn, method, path, body, headers)
        text = resp.read().decode()
        is_json = (resp.getheader("content-type") or "").startswith("application/json")
        return resp.status, json.loads(text) if is_json else text
    finally:
        conn.close()


@contextlib.contextmanager
def served(runtime, model: str, max_tokens: int) -> Iterator[tuple[str, Any]]:
    """`runtime` served as `model` (default max_tokens `max_tokens`): (base URL, an openai.OpenAI client on it)."""
    import openai

    from cli.serve.app import build_app
    from specexec.config import SamplingParams
    from specexec.serving.openai_api import ServerDefaults

    with running(build_app(runtime, ServerDefaults(model, SamplingParams(), max_tokens))) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            yield base, client
        finally:
            client.close()
