"""The Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) as pure functions: a Messages
request -> the chat-completions body the chat path already reads, a finished answer -> the `message` object,
and errors in Anthropic's shape.

Requests (`read_request`): `system` (a string or text blocks) becomes the first message; `messages` (user and
assistant turns, content a string or blocks: `text`, an assistant's `tool_use` blocks -> its tool_calls, a user's
`tool_result` blocks -> tool messages before its text; `thinking` blocks a client echoes are skipped; images and
documents are a 400) become chat messages; `tools` ({"name", "description", "input_schema"}; server tools are a
400) become function tools; `tool_choice` auto | any | tool (named) | none becomes auto | required | named |
none, so `any` and `tool` run under the grammar of the model's call format inside the tree like the chat path's
forced calls (specexec/serving/tool_grammars.py); `disable_parallel_tool_use` becomes parallel_tool_calls false;
`stop_sequences` become stop strings; `output_config.format` (json_schema) becomes response_format, under its
grammar; `max_tokens` (required), `temperature`, `top_p`, `top_k` pass through;
`metadata` ({"user_id"}), `cache_control`, `thinking` and `service_tier` are accepted and change nothing. The
rest of the checks are the chat path's (openai_api.py, messages.py, tools.py); their errors are renamed to this
request's fields (`rename_error`).

Answers (`message_object`): content blocks (a `text` block when there is content or no call; a `tool_use`
block per call, its `input` an object), stop_reason end_turn | max_tokens | stop_sequence (with the stop
sequence met) | tool_use, usage with input_tokens (those computed), cache_read_input_tokens (prompt tokens
whose KV was reused) and output_tokens, and the `specexec` extension.

Does not know: HTTP, the stream's events (specexec/serving/anthropic_stream.py), how calls are parsed
(specexec/serving/tools.py), generation.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from specexec.runtime.detokenizer import Detokenizer
from specexec.serving import openai_api as api

# Anthropic's error type of each HTTP status (others: api_error)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}
SKIPPED_BLOCKS = ("thinking", "redacted_thinking")       # a client echoes them; this server writes none
# chat-path parameter names -> the Messages request's
PARAMS = {"stop": "stop_sequences", "tool_choice": "tool_choice", "messages": "messages", "tools": "tools"}


@dataclass(frozen=True)
class MessagesRequest:
    """A checked Messages request: the chat body it runs as, whether it streams, its stop sequences."""

    chat: dict
    stream: bool = False
    stop_sequences: tuple[str, ...] = ()


def _bad(message: str, param: str = "messages") -> api.ApiError:
    return api.ApiError(message, param=param, code="invalid_value")


def error_body(err: api.ApiError) -> dict:
    """{"type": "error", "error": {"type", "message"}} as Anthropic sends it."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def _text_blocks(content: Any, param: str) -> str:
    """A string or an array of text blocks as text (tool_result content, system)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"'{param}' must be a string or an array of text blocks", param)
    parts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else block
            raise _bad(f"{param}[{i}]: only text blocks ({{'type': 'text', 'text'}}) are supported here, got "
                       f"{json.dumps(kind)[:40]}", param)
        parts.append(block["text"])
    return "".join(parts)


def _blocks(content: Any, i: int) -> Iterator[tuple[Any, str, Any]]:
    """messages[i]'s content blocks as (type, where it is for errors, the block); not an array: a 400."""
    if not isinstance(content, list):
        raise _bad(f"messages[{i}].content must be a string or an array of content blocks")
    for j, block in enumerate(content):
        yield (block.get("type") if isinstance(block, dict) else None), f"messages[{i}].content[{j}]", block


def _user(content: Any, i: int) -> list[dict]:
    """A user turn: a tool message per tool_result block, then a user message with its text (if any)."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out, text = [], []
    for kind, where, block in _blocks(content, i):
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise _bad(f"{where} (tool_result) needs 'tool_use_id'")
            result = _text_blocks(block.get("content", ""), f"{where}.content")
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": f"Error: {result}" if block.get("is_error") else result})
        elif kind not in SKIPPED_BLOCKS:
            raise _bad(f"{where}: blocks of type {json.dumps(kind)} are not supported (text, tool_use, "
                       "tool_result)")
    return out + ([{"role": "user", "content": "".join(text)}] if text or not out else [])


def _assistant(content: Any, i: int) -> dict:
    """An assistant turn: its text blocks as content, its tool_use blocks as tool_calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    text, calls = [], []
    for kind, where, block in _blocks(content, i):
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise _bad(f"{where} (tool_use) needs 'id', 'name' and 'input' (an object)")
            calls.append({"id": block.get("id") or new_id("toolu"), "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        elif kind not in SKIPPED_BLOCKS:
            raise _bad(f"{where}: blocks of type {json.dumps(kind)} are not supported in an assistant turn "
                       "(text, tool_use)")
    return {"role": "assistant", "content": "".join(text), **({"tool_calls": calls} if calls else {})}


def chat_messages(body: dict) -> list[dict]:
    """`system` and `messages` as chat messages."""
    out = []
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array of {'role': 'user' | 'assistant', 'content'} objects")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            out += _user(m.get("content"), i)
        elif role == "assistant":
            out.append(_assistant(m.get("content"), i))
        else:
            raise _bad(f"messages[{i}].role must be 'user' or 'assistant' (the system prompt goes in 'system')")
    return out


def _tools(body: dict) -> tuple[list[dict] | None, Any, bool | None]:
    """(chat tools, chat tool_choice, parallel_tool_calls) of the request's tools and tool_choice."""
    given, choice = body.get("tools"), body.get("tool_choice")
    chat_tools = None
    if given is not None:
        if not isinstance(given, list):
            raise _bad("'tools' must be an array of {'name', 'description', 'input_schema'} objects", "tools")
        chat_tools = []
        for i, t in enumerate(given):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                kind = t.get("type") if isinstance(t, dict) else t
                raise _bad(f"tools[{i}]: only client tools ({{'name', 'input_schema'}}) are supported, got "
                           f"{json.dumps(kind)[:60]}", "tools")
            fn = {"name": t.get("name"), "parameters": t.get("input_schema", {"type": "object", "properties": {}})}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            chat_tools.append({"type": "function", "function": fn})
    if choice is None:
        return chat_tools or None, None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    kinds = {"auto": "auto", "any": "required", "none": "none"}
    if kind in kinds:
        chat_choice: Any = kinds[kind]
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat_choice = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise _bad("'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name'}",
                   "tool_choice")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("'tool_choice.disable_parallel_tool_use' must be a boolean", "tool_choice")
    return chat_tools or None, chat_choice, None if parallel is None else not parallel


def _metadata(body: dict) -> None:
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or not isinstance(metadata.get("user_id", ""),
                                                                                   (str, type(None)))):
        raise _bad("'metadata' must be an object ({'user_id': a string})", "metadata")


def _output_format(body: dict) -> dict | None:
    """output_config.format ({"type": "json_schema", "schema"}) -> the chat path's response_format."""
    config = body.get("output_config")
    fmt = config.get("format") if isinstance(config, dict) else None
    if config is not None and not isinstance(config, dict) or fmt is None:
        if config is not None and not isinstance(config, dict):
            raise _bad("'output_config' must be an object", "output_config")
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("'output_config.format' must be {'type': 'json_schema', 'schema': {...}}", "output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def read_request(body: dict, counting: bool = False) -> MessagesRequest:
    """Check a Messages request and translate it into the chat body it runs as; counting: a count_tokens
    request (no max_tokens, nothing generated)."""
    if not counting and body.get("max_tokens") is None:
        raise _bad("'max_tokens' is required", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    _metadata(body)
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("'stop_sequences' must be an array of strings", "stop_sequences")
    tools, choice, parallel = _tools(body)
    chat: dict = {k: body[k] for k in ("model", "max_tokens", "temperature", "top_p", "top_k")
                  if body.get(k) is not None}
    chat.update(messages=chat_messages(body), stream=stream and not counting, stop=stops)
    for key, value in (("tools", tools), ("tool_choice", choice), ("parallel_tool_calls", parallel),
                       ("response_format", _output_format(body))):
        if value is not None:
            chat[key] = value
    return MessagesRequest(chat, stream and not counting, tuple(s for s in stops if s))


def rename_error(err: api.ApiError) -> api.ApiError:
    """A chat-path error in the Messages request's terms ('stop' -> 'stop_sequences', ...)."""
    param = PARAMS.get((err.param or "").split("[")[0].split(".")[0], err.param)
    message = err.message.replace("'stop'", "'stop_sequences'")
    return api.ApiError(message, param, err.code, err.status, err.kind)


# ------------------------------------------------------------------------------------------ answers

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_met(choice: api.Choice, prompt: Sequence[int], stops: tuple[str, ...], tokenizer) -> str | None:
    """The stop sequence that ended a choice, or None. The text ends just before the first stop string and its
    ids run up to the token that string begins in (Runtime.generate_text), so what those ids decode to past the
    text is the stop sequence's beginning (or all of it and more); the first of `stops` that fits is named."""
    if choice.finish_reason != "stop" or not stops or choice.tool_calls:
        return None
    rest = Detokenizer(tokenizer, prompt).stable_text(choice.ids)[len(choice.text):]
    if not rest:
        return None
    return next((s for s in stops if rest.startswith(s) or s.startswith(rest)), None)


def stop_reason(choice: api.Choice, stop: str | None) -> str:
    if choice.tool_calls:
        return "tool_use"
    if stop is not None:
        return "stop_sequence"
    return "max_tokens" if choice.finish_reason == "length" else "end_turn"


def tool_use_block(call: dict) -> dict:
    """A tool_use content block of a chat tool call ({"function": {"name", "arguments"}})."""
    fn = call["function"]
    try:
        arguments = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        arguments = None
    return {"type": "tool_use", "id": new_id("toolu"), "name": fn["name"],
            "input": arguments if isinstance(arguments, dict) else {}}


def content_blocks(choice: api.Choice) -> list[dict]:
    """A text block when the answer has text or no call, then a tool_use block per call."""
    blocks = [{"type": "text", "text": choice.text}] if choice.text or not choice.tool_calls else []
    return blocks + [tool_use_block(c) for c in choice.tool_calls]


def usage(job: api.Job, choice: api.Choice | None) -> dict:
    """input_tokens: the prompt's tokens computed; cache_read_input_tokens: those whose KV was reused."""
    prompt = len(job.prompts[0])
    cached = min((choice.stats.get("reused_tokens") or 0) if choice is not None else 0, prompt)
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": choice.completion_tokens if choice is not None else 0}


def message_object(job: api.Job, content: list[dict], choice: api.Choice | None = None,
                   stop: str | None = None, queue_ms: float | None = None) -> dict:
    """The `message` object: a stream's first one (no choice yet: empty content, no stop_reason), else the
    finished one with its content blocks, stop reason, usage and the specexec extension."""
    out = {"id": job.id, "type": "message", "role": "assistant", "model": job.model, "content": content,
           "stop_reason": stop_reason(choice, stop) if choice is not None else None,
           "stop_sequence": stop, "usage": usage(job, choice)}
    if choice is not None and queue_ms is not None:
        out["specexec"] = api.extension([choice], queue_ms)
    return out
