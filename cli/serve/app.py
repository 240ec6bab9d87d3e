"""The ASGI app behind `specexec serve`: starlette routes over one GenerationQueue (specexec/serving/queue.py).

Routes: POST /v1/chat/completions (with tools: specexec/serving/tools.py), /v1/completions, /v1/responses
(the Responses API: specexec/serving/responses.py runs it as the chat body it translates to) and /v1/messages
(Anthropic's Messages API, likewise: specexec/serving/anthropic_api.py; its errors in Anthropic's shape), each
as JSON or server-sent events (specexec/serving/chat_stream.py, response_stream.py, anthropic_stream.py),
/v1/messages/count_tokens, GET /v1/models, /v1/models/{id}, /health and /metrics (Prometheus text;
`?format=json` for JSON). With an API key every route but /health wants `Authorization: Bearer KEY` or
`x-api-key: KEY` (401 otherwise). Each request is read (at most max_body bytes), made into its Job
(specexec/serving/jobs.py: checked and tokenized on one helper thread; its grammar compiled on a small pool of
its own, so a plain request never waits behind a schema; a compile over grammar_seconds is a 400), then queued:
the engine runs on the queue's worker threads (--parallel of them), so the loop stays free to answer /health,
/metrics and new requests while generations run. A client that disconnects (streamed or not) cancels its job: a waiting one
leaves the queue at once, a running one stops at its next step. Every failure is an OpenAI-style JSON error
body: 4xx for the client's mistakes, 500 only for bugs, and the server lives on. With an access_log, one line
per request: method, path, status, generated tokens, its wait (for the tokenizing thread, a grammar thread and
the worker), seconds, the queue's depth (a stream's when it ends; 499 when its client left). /metrics counts
the worker's wait (specexec_queue_wait_seconds_total, the mean, the last job's).

Importing this module needs starlette (the `serve` extra); cli/serve/command.py imports it only when serving.

Does not know: request semantics (specexec.serving.openai_api, jobs.py), how jobs run (specexec.serving.queue), argument parsing
and binding sockets (cli/serve/command.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from specexec.options import ConfigError
from specexec.serving import anthropic_api as anth
from specexec.serving import openai_api as api
from specexec.serving import responses
from specexec.serving.anthropic_stream import MessagesStream
from specexec.serving.chat_stream import ChatStream, apply, finish_choices
from specexec.serving.jobs import JobMaker
from specexec.serving.response_stream import ResponseStream
from specexec.runtime.assembly import Runtime
from specexec.serving.queue import End, Failed, GenerationQueue, QueueFull, Ticket

Handler = Callable[[Request], Awaitable[Response]]
WAITED: contextvars.ContextVar[list[float]] = contextvars.ContextVar("waited")   # a request's seconds in pools


async def _off(pool: ThreadPoolExecutor, fn: Callable[[], Any], timeout: float | None = None) -> Any:
    """fn on `pool`, its wait for a thread added to the request's WAITED; TimeoutError after `timeout` s of
    running (the wait not counted)."""
    submitted, started = time.perf_counter(), asyncio.get_running_loop().create_future()
    loop = asyncio.get_running_loop()

    def run() -> Any:
        loop.call_soon_threadsafe(lambda: started.done() or started.set_result(time.perf_counter()))
        return fn()
    future = asyncio.wrap_future(pool.submit(run))
    if timeout is None:
        result = await future
    else:
        await asyncio.wait({started, future}, return_when=asyncio.FIRST_COMPLETED)
        result = await asyncio.wait_for(asyncio.shield(future), timeout) if not future.done() else future.result()
    waited = WAITED.get(None)
    if waited is not None and started.done():
        waited[0] += started.result() - submitted
    return result


@dataclass(frozen=True)
class ServeSettings:
    api_key: str | None = None
    max_queue: int = 64                    # waiting requests before 429
    max_body: int = 8 * 2**20              # request body bytes before 413
    access_log: Callable[[str], None] | None = None    # hears one line per request (None: no access log)
    max_choices: int = 64                  # prompts x n of one request before 400 (it holds a worker)
    grammar_threads: int = 2               # grammars compiled at once, beside the tokenizing thread
    grammar_seconds: float = 30.0          # a request's grammar compile (and check) before 400
    parallel: int = 1                      # requests running at once (their trees share each target pass)


def error_response(err: api.ApiError) -> JSONResponse:
    return JSONResponse(api.api_error_body(err), status_code=err.status)


def anthropic_error_response(err: api.ApiError) -> JSONResponse:
    return JSONResponse(anth.error_body(err), status_code=err.status)


class EventStream(StreamingResponse):
    """text/event-stream that always watches for the client going away (whatever ASGI version the server
    speaks): a disconnect cancels the body iterator, whose cleanup cancels the job."""

    media_type = "text/event-stream"

    async def __call__(self, _scope: Any, receive: Any, send: Any) -> None:
        async with anyio.create_task_group() as group:
            async def stream() -> None:
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                group.cancel_scope.cancel()
            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next_event(ticket: Ticket, gone: asyncio.Future) -> Any:
    """The ticket's next event, or None when the client disconnected first."""
    get = asyncio.ensure_future(ticket.events.get())
    done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    return None


class Server:
    """The routes' state: the runtime, its queue, the defaults requests start from, request counters."""

    def __init__(self, runtime: Runtime, defaults: api.ServerDefaults, settings: ServeSettings) -> None:
        self.runtime, self.defaults, self.settings = runtime, defaults, settings
        self.queue = GenerationQueue(runtime, settings.max_queue, settings.parallel)
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="specexec-tokenize")
        self.grammar_pool = ThreadPoolExecutor(settings.grammar_threads, thread_name_prefix="specexec-grammar")
        self.requests: Counter[tuple[str, int]] = Counter()
        self.created = int(time.time())
        self.vocab_size = runtime.target_info.args.vocab_size
        self.jobs = JobMaker(runtime, defaults, self.vocab_size)

    # ---------------------------------------------------------------- plumbing
    def route(self, handler: Handler, template: str, guarded: bool = True,
              errors: Callable[[api.ApiError], Response] = error_response) -> Handler:
        """Wrap a handler: API key check, ApiError/ConfigError -> the API's error body (`errors`: OpenAI's by
        default), request counting by the route's `template` (never the raw path: /metrics stays bounded
        whatever paths clients send)."""
        async def endpoint(request: Request) -> Response:
            request.state.started = time.perf_counter()
            request.state.waited = [0.0]                      # seconds in the tokenizing and grammar pools
            WAITED.set(request.state.waited)
            try:
                if guarded:
                    self._authorize(request)
                response = await handler(request)
            except api.ApiError as e:
                response = errors(e)
            except ConfigError as e:
                response = errors(api.ApiError(str(e)))
            self.requests[(template, response.status_code)] += 1
            if not isinstance(response, EventStream):         # a stream logs itself when it ends
                self._access(request, response.status_code)
            return response
        return endpoint

    def _access(self, request: Request, status: int, tokens: int | None = None, queue_ms: float | None = None
                ) -> None:
        """The access log line: method, path, status, generated tokens, queue wait and seconds."""
        if self.settings.access_log is None:
            return
        tokens = getattr(request.state, "tokens", None) if tokens is None else tokens
        queue_ms = getattr(request.state, "queue_ms", None) if queue_ms is None else queue_ms
        seconds = time.perf_counter() - request.state.started
        counted = "-" if tokens is None else tokens
        waited = (queue_ms or 0) / 1000 + request.state.waited[0]       # the worker's queue, and the pools'
        self.settings.access_log(f"{request.method} {request.url.path} {status} tokens={counted} "
                                 f"wait={waited:.2f}s {seconds:.2f}s queue={self.queue.depth}")

    def _authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.encode(), key.encode()):
            raise api.ApiError("missing or incorrect API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                               code="invalid_api_key", status=401)

    async def _body(self, request: Request) -> dict:
        limit = self.settings.max_body
        length = request.headers.get("content-length", "")
        too_big = api.ApiError(f"the request body exceeds {limit} bytes", code="request_too_large", status=413)
        if length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return api.read_json(b"".join(chunks))

    async def _tokenize(self, fn: Callable[[], Any]) -> Any:
        """fn on the one tokenizing thread (its wait there counts in the access log's wait)."""
        return await _off(self.tokenize_pool, fn)

    async def _compile(self, fn: Callable[[], Any], param: str) -> Any:
        """A grammar compiled and checked on the grammar pool (never the tokenizing thread: a plain request does
        not wait behind a schema); its wait for a thread counts in the access log's wait; more than
        grammar_seconds compiling is a 400 naming `param` (the thread finishes the compile, its result unused)."""
        limit = self.settings.grammar_seconds
        try:
            return await _off(self.grammar_pool, fn, limit)
        except TimeoutError:
            raise api.ApiError(f"the grammar took more than {limit:g} s to compile and check; simplify the schema "
                               "(fewer properties or alternatives, shorter patterns)", param=param,
                               code="grammar_too_complex") from None

    # ---------------------------------------------------------------- generation routes
    async def chat(self, request: Request) -> Response:
        job = await self._chat_job(await self._body(request))
        return await self._run(request, job)

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses: the Responses request runs as the chat body it translates to."""
        req = responses.read_request(await self._body(request))
        try:
            job = replace(await self._chat_job(req.chat), id=responses.new_id("resp"))
        except api.ApiError as e:
            raise responses.rename_error(e) from None
        return await self._run(request, job, req)

    async def messages(self, request: Request) -> Response:
        """POST /v1/messages: the Anthropic Messages request runs as the chat body it translates to."""
        req = anth.read_request(await self._body(request))
        try:
            job = replace(await self._chat_job(req.chat), id=anth.new_id("msg"))
        except api.ApiError as e:
            raise anth.rename_error(e) from None
        return await self._run(request, job, req)

    async def count_tokens(self, request: Request) -> Response:
        """POST /v1/messages/count_tokens: the prompt's tokens as the model's chat template renders them."""
        chat = anth.read_request(await self._body(request), counting=True).chat
        return JSONResponse({"input_tokens": await self._tokenize(lambda: self.jobs.count_tokens(chat))})

    async def _chat_job(self, body: dict) -> api.Job:
        """A chat body's Job (specexec/serving/jobs.py), made off the event loop (it tokenizes), its grammar
        compiled on the grammar pool."""
        job = await self._tokenize(lambda: self.jobs.chat(body, with_grammar=False))
        return await self._with_grammar(job, self.jobs.grammar_for(body))

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        job = await self._tokenize(lambda: self.jobs.completion(body, with_grammar=False))
        return await self._run(request, await self._with_grammar(job, self.jobs.grammar_for(body)))

    async def _with_grammar(self, job: api.Job, compile: tuple[Callable[[], str | None], str] | None) -> api.Job:
        """`job` with the grammar `compile` makes (None: free text)."""
        return job if compile is None else replace(job, grammar=await self._compile(*compile))

    async def _run(self, request: Request, job: api.Job,
                   req: responses.ResponseRequest | anth.MessagesRequest | None = None) -> Response:
        """Queue the job; its answer streamed or whole, in the chat/completions shape or (req) the Responses
        API's or the Messages API's."""
        self.jobs.admit(job, self.settings.max_choices)
        try:
            ticket = self.queue.submit(job)
        except QueueFull as e:
            raise api.ApiError(str(e), code="queue_full", status=429, kind="server_error") from None
        tok = self.runtime.tokenizer
        if job.stream:
            shape = (MessagesStream(req, job, tok) if isinstance(req, anth.MessagesRequest) else
                     ResponseStream(req, job, tok) if req is not None else ChatStream(job, tok))
            return EventStream(self._stream(ticket, request, shape), headers={"Cache-Control": "no-cache",
                                                                              "X-Accel-Buffering": "no"})
        result = await self._collect(request, ticket)
        if result is None:                                  # the client is gone: nobody reads this
            return Response(status_code=499)
        choices, queue_ms = result
        request.state.tokens, request.state.queue_ms = sum(c.completion_tokens for c in choices), queue_ms
        finish_choices(job, choices, tok)
        if isinstance(req, anth.MessagesRequest):
            c = choices[0]
            stop = anth.stop_met(c, job.prompts[0], req.stop_sequences, tok)
            return JSONResponse(anth.message_object(job, anth.content_blocks(c), c, stop, queue_ms))
        if req is not None:
            c = choices[0]
            output = responses.output_items(c, job.logprobs is not None)
            return JSONResponse(responses.response_object(req, job, output, responses.status_of(c), c, queue_ms))
        build = api.chat_response if job.kind == "chat" else api.completion_response
        return JSONResponse(build(job, choices, queue_ms))

    async def _collect(self, request: Request, ticket: Ticket) -> tuple[list[api.Choice], float] | None:
        """Every event of a non-streamed job; None when the client disconnected (the job is cancelled)."""
        choices = [api.Choice(i) for i in range(ticket.job.choices)]
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while (event := await _next_event(ticket, gone)) is not None:
                if isinstance(event, End):
                    return choices, event.queue_ms
                if isinstance(event, Failed):
                    raise api.ApiError(event.message, code="generation_failed", status=500, kind="server_error")
                apply(event, choices)
            return None
        finally:
            gone.cancel()
            ticket.cancel()

    async def _stream(self, ticket: Ticket, request: Request, shape: ChatStream | ResponseStream | MessagesStream
                      ) -> AsyncIterator[bytes]:
        """SSE frames as the worker's events arrive, shaped by `shape`; cancelling this iterator cancels the job
        (499 in the access log)."""
        choices = [api.Choice(i) for i in range(ticket.job.choices)]
        event: Any = None
        try:
            for frame in shape.opening():
                yield frame
            while not isinstance(event := await ticket.events.get(), End):
                for frame in shape.on(event, choices):
                    yield frame
            for frame in shape.closing(event, choices):
                yield frame
        finally:
            ticket.cancel()
            self._access(request, 200 if isinstance(event, End) else 499,
                         sum(c.completion_tokens for c in choices), getattr(event, "queue_ms", None))

    # ---------------------------------------------------------------- other routes
    async def models(self, request: Request) -> Response:
        return JSONResponse(api.models_list(self.defaults.model_id, self.created))

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.defaults.model_id:
            raise api.ApiError(f"the model {model_id!r} does not exist; this server has {self.defaults.model_id!r}",
                               param="model", code="model_not_found", status=404)
        return JSONResponse(api.model_card(model_id, self.created))

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.defaults.model_id, "queue_depth": self.queue.depth,
                             "busy": self.queue.busy, "running": self.queue.running, "parallel": self.queue.parallel})

    async def metrics(self, request: Request) -> Response:
        snap = {**self.queue.metrics.snapshot(), "queue_depth": self.queue.depth, "busy": self.queue.busy,
                "running": self.queue.running, "parallel": self.queue.parallel, **self.queue.forest(),
                "requests": [{"path": p, "status": s, "count": n} for (p, s), n in sorted(self.requests.items())]}
        if request.query_params.get("format") == "json":
            return JSONResponse(snap)
        return PlainTextResponse(prometheus_text(snap), media_type="text/plain; version=0.0.4")

    def close(self) -> None:
        self.queue.close()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.grammar_pool.shutdown(wait=False, cancel_futures=True)


# name -> (type, help, snapshot key)
PROMETHEUS = {
    "specexec_queue_depth": ("gauge", "Requests waiting for the generation worker.", "queue_depth"),
    "specexec_busy": ("gauge", "1 while a generation runs.", "busy"),
    "specexec_running": ("gauge", "Requests running now (their trees share each target pass).", "running"),
    "specexec_parallel": ("gauge", "Requests that may run at once (--parallel).", "parallel"),
    "specexec_forest_passes_total": ("counter", "Target passes shared by the running requests.", "forest_passes"),
    "specexec_forest_requests_total": ("counter", "Requests those passes carried (summed over passes).",
                                       "forest_requests"),
    "specexec_forest_size_mean": ("gauge", "Requests per shared target pass, all time.", "forest_size_mean"),
    "specexec_forest_size_last": ("gauge", "Requests the last shared target pass carried.", "forest_size_last"),
    "specexec_jobs_submitted_total": ("counter", "Generation jobs accepted into the queue.", "jobs_submitted"),
    "specexec_generated_tokens_total": ("counter", "Tokens generated.", "generated_tokens"),
    "specexec_prefilled_tokens_total": ("counter", "Prompt tokens run through the target.", "prefilled_tokens"),
    "specexec_reused_tokens_total": ("counter", "Prompt tokens whose KV cache was reused.", "reused_tokens"),
    "specexec_steps_total": ("counter", "Target passes (decoding steps).", "steps"),
    "specexec_decode_seconds_total": ("counter", "Seconds spent drafting and verifying.", "decode_seconds"),
    "specexec_streamed_bytes_total": ("counter", "Target weight bytes streamed (offloaded).", "bytes_streamed"),
    "specexec_tokens_per_step": ("gauge", "Generated tokens per target pass, all time.", "tokens_per_step"),
    "specexec_tokens_per_second": ("gauge", "Generated tokens per decoding second, all time.", "tokens_per_second"),
    "specexec_jobs_started_total": ("counter", "Generation jobs the worker started.", "jobs_started"),
    "specexec_queue_wait_seconds_total": ("counter", "Seconds jobs waited for the worker.", "queue_seconds"),
    "specexec_queue_wait_ms_mean": ("gauge", "Mean wait for the worker, all time (ms).", "queue_wait_ms_mean"),
}
LAST = {"queue_ms": "How long the last job waited for the worker (ms).",
        "tokens_per_second": "Decode tokens/s of the last generation.",
        "tokens_per_step": "Tokens per target pass of the last generation.",
        "effective_gb_s": "Streamed GB/s of the last generation (offloaded target only)."}


def label(value: object) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped (the text format's rules)."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(snap: dict) -> str:
    """The /metrics snapshot in the Prometheus text exposition format (values that are unknown are left out)."""
    lines = []
    for name, (kind, text, key) in PROMETHEUS.items():
        if snap.get(key) is not None:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {float(snap[key]):g}"]
    for key, text in LAST.items():
        if snap["last"].get(key) is not None:
            name = f"specexec_last_{key}"
            lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name} {float(snap['last'][key]):g}"]
    lines += ["# HELP specexec_jobs_total Generation jobs by outcome.", "# TYPE specexec_jobs_total counter"]
    lines += [f'specexec_jobs_total{{outcome="{o}"}} {snap[f"jobs_{o}"]:g}'
              for o in ("completed", "cancelled", "failed")]
    lines += ["# HELP specexec_requests_total HTTP requests by route (its template, never the raw path) and status.",
              "# TYPE specexec_requests_total counter"]
    lines += [f'specexec_requests_total{{path="{label(r["path"])}",status="{label(r["status"])}"}} {r["count"]}'
              for r in snap["requests"]]
    return "\n".join(lines) + "\n"


async def _not_found(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 404
    message = f"{request.method} {request.url.path}: " + ("no such route" if status == 404 else
                                                          getattr(exc, "detail", "refused"))
    return error_response(api.ApiError(message, code="not_found" if status == 404 else None, status=status))


async def _server_error(request: Request, exc: Exception) -> Response:
    return error_response(api.ApiError(f"internal error {type(exc).__name__}: {exc}", status=500,
                                       kind="server_error"))


def build_app(runtime: Runtime, defaults: api.ServerDefaults, settings: ServeSettings = ServeSettings()) -> Starlette:
    """The app; its lifespan starts the generation worker and stops it (cancelling what runs) at shutdown."""
    server = Server(runtime, defaults, settings)
    def route(path: str, handler: Handler, method: str, guarded: bool = True,
              errors: Callable[[api.ApiError], Response] = error_response) -> Route:
        return Route(path, server.route(handler, path, guarded, errors), methods=[method])

    routes = [route("/v1/chat/completions", server.chat, "POST"),
              route("/v1/messages", server.messages, "POST", errors=anthropic_error_response),
              route("/v1/messages/count_tokens", server.count_tokens, "POST", errors=anthropic_error_response),
              route("/v1/responses", server.responses, "POST"),
              route("/v1/completions", server.completions, "POST"),
              route("/v1/models", server.models, "GET"),
              route("/v1/models/{model_id:path}", server.model, "GET"),
              route("/health", server.health, "GET", guarded=False),
              route("/metrics", server.metrics, "GET")]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.queue.start()
        try:
            yield
        finally:
            server.close()

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _not_found, Exception: _server_error})
    app.state.server = server
    return app
