"""The OpenAI HTTP API as pure functions: request bodies -> a validated `Job`, generation events -> response
bodies, stream chunks and server-sent events, and OpenAI-style error bodies.

Requests: `read_json` parses a body; `parse_options` checks the fields both endpoints share (types here, values
through specexec.config and specexec.options: SamplingParams and check_number/check_integer are the one place values are judged);
`parse_prompts` reads what to continue (a chat's messages: specexec/serving/messages.py); `encode_text` turns
it into ids;
`make_job` checks lengths against the context and freezes everything into a Job. Fields that common clients
send are accepted: unknown ones are ignored, known ones asking for something this engine cannot do exactly
(the legacy functions, suffix) are a 400 that says so; response_format is specexec/serving/structured.py's,
tools specexec/serving/tools.py's (chat only). logprobs / top_logprobs (chat: a boolean and 0..20;
/v1/completions: 0..5) come from the target's processed distribution where each token was chosen
(specexec/serving/logprobs.py shapes them); logit_bias ({"token id": bias in [-100, 100]}) goes to both models
through SamplingParams. presence_penalty and frequency_penalty
(in [-2, 2], else a 400) apply with OpenAI's semantics over the tokens this request generates, exactly per tree
node (specexec.sampling); repetition_penalty (HF's, over the whole context) is accepted too.
Omitted sampling fields take the server's defaults (its --temperature etc.), not OpenAI's temperature 1.

Responses: `chat_response` / `completion_response` (non-streamed) and `chunk` (either kind) / `usage_chunk`
(streamed, framed by `sse`, ended by SSE_DONE), each with `usage` and a `specexec` extension holding the
engine's step statistics.

Does not know: HTTP, sockets, the ASGI framework, threads and queues (specexec/serving/queue.py and
cli/serve/app.py do), how a token is generated (specexec.runtime.assembly).
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import specexec
from offload.formats.json_files import parse_json
from specexec.acceptance.parsing import parse as parse_accept
from specexec.config import EXACT, Acceptance, SamplingParams
from specexec.options import ConfigError, check_integer, check_prompt_length
from specexec.serving import logprobs as lp

SSE_DONE = b"data: [DONE]\n\n"
MAX_N = 16                 # choices per request
MAX_STOP = 16              # stop strings per request
MAX_PROMPTS = 64           # prompts in one /v1/completions request
# request field -> SamplingParams field, for the fields a request may set per call
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                   "frequency_penalty": "frequency_penalty", "seed": "seed"}


class ApiError(ConfigError):
    """A request the server refuses: HTTP `status` and the OpenAI error body's type/param/code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}} as OpenAI sends it."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def api_error_body(err: ApiError) -> dict:
    return error_body(err.message, err.kind, err.param, err.code)


# ------------------------------------------------------------------------------------------- requests

@dataclass(frozen=True)
class ServerDefaults:
    """What the server was started with: the model id it reports, default sampling and answer length."""

    model_id: str
    sampling: SamplingParams = SamplingParams()
    max_tokens: int = 128          # default for a request that names none (capped by the context left)
    aliases: tuple[str, ...] = ()  # other model names requests may use (--served-model-name's further names)
    accept: Acceptance = EXACT     # the server's --accept (a request's "accept" field replaces it)


@dataclass(frozen=True)
class Options:
    """The prompt-independent fields of one request, checked. `model` must be the served model's id or one of
    its aliases (else a 404 model_not_found); responses name the served model."""

    model: str
    n: int
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    echo: bool = False
    logprobs: int | None = None        # top_logprobs per token (None: no log-probs)
    accept: Acceptance = EXACT         # "accept": exact | relaxed[:delta=D,k=K] (LOSSY; system_fingerprint says so)


@dataclass(frozen=True)
class Job:
    """One request, ready for the worker: every prompt as ids, n choices per prompt (choice index =
    prompt index * n + sample index; sample i of a seeded request uses seed + choice index)."""

    kind: str                                  # "chat" | "text"
    id: str
    created: int
    model: str
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]                # per prompt
    n: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    echo_texts: tuple[str, ...] = ()           # /v1/completions echo=true: each prompt's text
    logprobs: int | None = None                # top_logprobs per token (None: no log-probs)
    grammar: str | None = None                 # every choice's grammar (llguidance's text; None: free text)
    tool_format: str | None = None             # the tool-call format answers are parsed in (serving/tools.py)
    accept: Acceptance = EXACT                 # how drafted tokens are judged (relaxed: LOSSY)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def sampling_for(self, choice: int) -> SamplingParams:
        seed = self.sampling.seed
        return self.sampling if seed is None or choice == 0 else replace(self.sampling, seed=seed + choice)


def read_json(body: bytes) -> dict:
    """The request body as a JSON object; ApiError for anything else."""
    obj = parse_json(body, "the request body", ApiError)      # every body the parser rejects: a 400
    if not isinstance(obj, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(obj).__name__}")
    return obj


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object"}


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    """body[name] if it has one of `kinds` (null/absent -> default); ints count as numbers, bools never do."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        want = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
        raise ApiError(f"'{name}' must be {want}, got {json.dumps(value)[:80]}", param=name, code="invalid_type")
    return value


def _checked(param: str, check, *args: Any) -> None:
    """Run a specexec.options check; its ConfigError becomes an ApiError naming `param`."""
    try:
        check(*args)
    except ConfigError as e:
        raise ApiError(str(e), param=param, code="invalid_value") from None


def _unsupported(body: dict) -> None:
    """400 for known fields that ask for what this engine cannot do exactly; their neutral values pass."""
    checks = (("functions", (list,), lambda v: not v), ("suffix", (str,), lambda v: v == ""))
    for name, kinds, neutral in checks:
        value = _field(body, name, kinds)
        if value is not None and not neutral(value):
            raise ApiError(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")


def _logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """logit_bias {"token id": bias} -> sorted (id, bias) pairs; ids must be the vocabulary's."""
    bias = _field(body, "logit_bias", (dict,), {})
    pairs = []
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else None
        if token is None or (vocab_size is not None and token >= vocab_size):
            raise ApiError(f"logit_bias key {key!r} is not a token id of this model's vocabulary"
                           + (f" (0..{vocab_size - 1})" if vocab_size else ""), param="logit_bias",
                           code="invalid_value")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(f"logit_bias[{key!r}] must be a number", param="logit_bias", code="invalid_type")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def _logprobs(body: dict) -> int | None:
    """top_logprobs per token, or None: chat's logprobs (boolean) + top_logprobs (0..20), or /v1/completions'
    logprobs (an integer 0..5)."""
    flag = _field(body, "logprobs", (bool, int))
    top = _field(body, "top_logprobs", (int,))
    if isinstance(flag, bool) or flag is None:
        if top is not None and top > 0 and not flag:
            raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
        if top is not None:
            _checked("top_logprobs", check_integer, "top_logprobs", top, 0, lp.MAX_TOP_CHAT)
        return (top or 0) if flag else None
    _checked("logprobs", check_integer, "logprobs", flag, 0, lp.MAX_TOP_TEXT)
    return flag


def _sampling(body: dict, defaults: SamplingParams, vocab_size: int | None = None) -> SamplingParams:
    """The server's defaults with the request's sampling fields on top, validated by SamplingParams."""
    known = {f.name for f in fields(SamplingParams)}
    given: dict[str, Any] = {"logit_bias": _logit_bias(body, vocab_size)}
    for name, target in SAMPLING_FIELDS.items():
        if target not in known:
            continue
        kinds = (int,) if target in ("top_k", "seed") else (int, float)
        value = _field(body, name, kinds)
        if value is not None:
            given[target] = value
    try:
        return replace(defaults, **given)
    except ConfigError as e:
        param = next((n for n in given if str(e).startswith(n)), None)
        raise ApiError(str(e), param=param, code="invalid_value") from None


def _stop(body: dict) -> tuple[str, ...]:
    stop = _field(body, "stop", (str, list), [])
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP or not all(isinstance(s, str) for s in stops):
        raise ApiError(f"'stop' must be a string or an array of at most {MAX_STOP} strings", param="stop",
                       code="invalid_value")
    return tuple(s for s in stops if s)


def parse_options(body: dict, defaults: ServerDefaults, vocab_size: int | None = None) -> Options:
    """Check the fields both endpoints share; raise ApiError naming the first bad one. vocab_size: the
    model's, for logit_bias ids."""
    _unsupported(body)
    model = _field(body, "model", (str,), defaults.model_id)
    if model != defaults.model_id and model not in defaults.aliases:
        raise ApiError(f"the model {model!r} does not exist; this server has {defaults.model_id!r}"
                       + (f" (also named {', '.join(defaults.aliases)})" if defaults.aliases else ""),
                       param="model", code="model_not_found", status=404)
    n = _field(body, "n", (int,), 1)
    _checked("n", check_integer, "n", n, 1, MAX_N)
    best_of = _field(body, "best_of", (int,), n)
    if best_of != n:
        raise ApiError("'best_of' other than n is not supported", param="best_of", code="unsupported_parameter")
    max_tokens = _field(body, "max_completion_tokens", (int,), None)
    max_tokens = _field(body, "max_tokens", (int,), max_tokens)
    if max_tokens is not None:
        _checked("max_tokens", check_integer, "max_tokens", max_tokens, 1, 10**7)
    stream = _field(body, "stream", (bool,), False)
    stream_options = _field(body, "stream_options", (dict,), {})
    include_usage = _field(stream_options, "include_usage", (bool,), False)
    return Options(model, n, max_tokens, _sampling(body, defaults.sampling, vocab_size), _stop(body), stream,
                   stream and include_usage, _field(body, "echo", (bool,), False), _logprobs(body),
                   _accept(body, defaults.accept))


def _accept(body: dict, default: Acceptance) -> Acceptance:
    """The request's "accept" (exact | relaxed[:delta=D,k=K], --accept's text), else the server's."""
    text = _field(body, "accept", (str,))
    if text is None:
        return default
    try:
        return parse_accept(text)
    except ConfigError as e:
        raise ApiError(str(e), param="accept", code="invalid_value") from None


def parse_prompts(body: dict, vocab_size: int) -> list[str | list[int]]:
    """/v1/completions 'prompt': a string, an array of strings, an array of token ids, or an array of those."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_id(t) for t in prompt):
            return [_ids(prompt, vocab_size)]
        if len(prompt) <= MAX_PROMPTS and all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if len(prompt) <= MAX_PROMPTS and all(isinstance(p, list) and p for p in prompt):
            return [_ids(p, vocab_size) for p in prompt]
    raise ApiError(f"'prompt' must be a string, an array of at most {MAX_PROMPTS} strings, an array of token ids "
                   "or an array of such arrays (none empty)", param="prompt", code="invalid_value")


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _ids(ids: list, vocab_size: int) -> list[int]:
    bad = next((t for t in ids if not _is_id(t) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(f"token id {bad!r} in 'prompt' is not an id of this model's vocabulary "
                       f"(0..{vocab_size - 1})", param="prompt", code="invalid_value")
    return list(ids)


def encode_text(tokenizer, prompt: str | list[int]) -> list[int]:
    """Prompt ids of a /v1/completions prompt (ids pass through): the tokenizer's default encoding."""
    return list(prompt) if isinstance(prompt, list) else list(tokenizer(prompt)["input_ids"])


def _budget(n_prompt: int, max_tokens: int | None, default: int, context: int, param: str) -> int:
    """max_tokens for one prompt: the request's (checked against the context) or the default, capped."""
    limit = max_tokens if max_tokens is not None else max(min(default, context - n_prompt), 1)
    try:
        check_prompt_length(n_prompt, limit, context)
    except ConfigError as e:
        code = "context_length_exceeded" if n_prompt else "invalid_value"
        raise ApiError(str(e).replace("--max-new-tokens", "max_tokens"), param=param, code=code) from None
    return limit


def make_job(kind: str, options: Options, prompts: Sequence[list[int]], defaults: ServerDefaults, context: int,
             echo_texts: Sequence[str] = (), grammar: str | None = None, tool_format: str | None = None) -> Job:
    """Freeze a request into a Job after checking every prompt plus its max_tokens against the context."""
    param = "messages" if kind == "chat" else "prompt"
    limits = tuple(_budget(len(p), options.max_tokens, defaults.max_tokens, context, param) for p in prompts)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return Job(kind, prefix + uuid.uuid4().hex[:24], int(time.time()), defaults.model_id,
               tuple(tuple(p) for p in prompts), limits, options.n, options.sampling, options.stop, options.stream,
               options.include_usage, tuple(echo_texts) if options.echo else (), options.logprobs, grammar,
               tool_format, options.accept)


# ------------------------------------------------------------------------------------------ responses

@dataclass
class Choice:
    """What one choice produced (filled in as its events arrive)."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: dict = field(default_factory=dict)
    logprobs: list[dict] = field(default_factory=list)     # logprobs.entries of its tokens
    ids: tuple[int, ...] = ()                              # its generated ids
    tool_calls: list[dict] = field(default_factory=list)   # parsed from its text (serving/tools.py)


def usage(choices: Sequence[Choice], job: Job) -> dict:
    """OpenAI usage: each prompt counted once, every choice's generated tokens; prompt_tokens_details.cached_tokens:
    the prompt tokens whose KV rows were reused (the engine's live prefix or the prefix cache), each prompt's
    first choice's."""
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(c.completion_tokens for c in choices)
    cached = sum(c.stats.get("reused_tokens") or 0 for c in choices if c.index % job.n == 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def extension(choices: Sequence[Choice], queue_ms: float) -> dict:
    """The `specexec` field: totals over the choices plus each choice's step statistics."""
    steps = sum(c.stats.get("steps", 0) for c in choices)
    tokens = sum(c.completion_tokens for c in choices)
    first = choices[0].stats if choices else {}
    return {"queue_ms": round(queue_ms, 2), "steps": steps,
            "tokens_per_step": round(tokens / steps, 3) if steps else None,
            "reused_tokens": first.get("reused_tokens"), "budget": first.get("budget"),
            "builder": first.get("builder"), "choices": [c.stats for c in choices]}


def fingerprint(accept: Acceptance) -> str:
    """system_fingerprint: the version and how drafted tokens were judged ("...-exact", "...-relaxed-d0.1-k10")."""
    mode = "exact" if not accept.relaxed else f"relaxed-d{accept.delta:g}-k{accept.k}"
    return f"specexec-{specexec.__version__}-{mode}"


def _head(job: Job, obj: str) -> dict:
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model,
            "system_fingerprint": fingerprint(job.accept)}


def _choice_logprobs(job: Job, items: Sequence[dict], offset: int = 0) -> dict | None:
    """A choice's (or chunk's) `logprobs` in the job's kind, or None when the request asked for none."""
    if job.logprobs is None:
        return None
    return lp.chat_logprobs(items) if job.kind == "chat" else lp.text_logprobs(items, offset)


def _message(c: Choice) -> dict:
    if not c.tool_calls:
        return {"role": "assistant", "content": c.text}
    return {"role": "assistant", "content": c.text or None, "tool_calls": c.tool_calls}


def chat_response(job: Job, choices: Sequence[Choice], queue_ms: float) -> dict:
    body = [{"index": c.index, "message": _message(c), "logprobs": _choice_logprobs(job, c.logprobs),
             "finish_reason": c.finish_reason} for c in choices]
    return {**_head(job, "chat.completion"), "choices": body, "usage": usage(choices, job),
            "specexec": extension(choices, queue_ms)}


def completion_response(job: Job, choices: Sequence[Choice], queue_ms: float) -> dict:
    body = [{"index": c.index, "text": c.text, "logprobs": _choice_logprobs(job, c.logprobs),
             "finish_reason": c.finish_reason} for c in choices]
    return {**_head(job, "text_completion"), "choices": body, "usage": usage(choices, job),
            "specexec": extension(choices, queue_ms)}


def _chunk_object(job: Job) -> str:
    return "chat.completion.chunk" if job.kind == "chat" else "text_completion"


def chunk(job: Job, index: int, text: str | None = None, finish_reason: str | None = None,
          stats: dict | None = None, opening: bool = False, logprobs: Sequence[dict] = (),
          tool_calls: Sequence[dict] = ()) -> dict:
    """One stream chunk for one choice, of the job's kind: new `text` (with its tokens' logprobs entries when
    the request asked), or (text None) the choice's end with its finish_reason and step stats; opening: a chat
    stream's first chunk (the assistant role, no text).
    A chat chunk carries a `delta`, a completion chunk `text`; `usage` is null when usage is requested, as
    OpenAI sends it."""
    if job.kind == "chat" and tool_calls:
        piece = {"delta": {"tool_calls": [{"index": k, **call} for k, call in enumerate(tool_calls)]}}
    elif job.kind == "chat":
        piece = {"delta": {"role": "assistant", "content": ""} if opening else
                 ({"content": text} if text is not None else {})}
    else:
        piece = {"text": text or ""}
    out = {**_head(job, _chunk_object(job)),
           "choices": [{"index": index, **piece, "logprobs": _choice_logprobs(job, logprobs) if text else None,
                        "finish_reason": finish_reason}]}
    if job.include_usage:
        out["usage"] = None
    if stats is not None:
        out["specexec"] = stats
    return out


def usage_chunk(job: Job, choices: Sequence[Choice], queue_ms: float) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage and the totals."""
    return {**_head(job, _chunk_object(job)), "choices": [], "usage": usage(choices, job),
            "specexec": extension(choices, queue_ms)}


def sse(obj: dict) -> bytes:
    """One server-sent event carrying `obj` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def models_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [model_card(model_id, created)]}


def model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "specexec",
            "specexec_version": specexec.__version__}
