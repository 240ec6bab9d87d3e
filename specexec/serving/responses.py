"""The OpenAI Responses API (POST /v1/responses) as pure functions: a Responses request -> the chat-completions
body the chat path already reads, and a finished answer -> the `response` object.

Requests (`read_request`): `input` (a string: one user message; or an item list: messages with text parts,
`function_call` items, `function_call_output` items, `reasoning` items skipped) and `instructions` (a system
message first) become `messages`; function tools ({"type": "function", "name", "parameters"}) become chat
tools, `tool_choice` {"type": "function", "name"} a named function; `text.format` (text, json_object,
json_schema with its `schema` beside `name`) becomes `response_format`; `max_output_tokens` becomes
max_tokens; `include: ["message.output_text.logprobs"]` (with `top_logprobs`) asks for log-probs (OpenAI's
other include values add nothing here; an unknown one is a 400, as is a `text` that is not an object). The rest of
the checks are the chat path's (specexec/serving/openai_api.py, messages.py, tools.py, structured.py); their
errors are renamed to the Responses fields (`rename_error`). Nothing is stored: `store` is answered false and
`previous_response_id` / `conversation` are a 400 that says to send the conversation as input items. Tools
other than functions (web search, file search, ...) are a 400.

Answers (`response_object`): output items (a `message` with one `output_text` part when there is content or no
call; a `function_call` item per call), status `completed` or `incomplete` (max_output_tokens), `usage` with
input/output tokens (`cached_tokens`: prompt tokens whose KV cache was reused), and the `specexec` extension.

Does not know: HTTP, the stream's events (specexec/serving/response_stream.py), how calls are parsed
(specexec/serving/tools.py), generation.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specexec.serving import openai_api as api

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's `include` values: the log-probs are this server's; the others name outputs of tools and stored state
# it has none of, so they add nothing; any other value is a 400, as OpenAI answers it
INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
            "web_search_call.action.sources", "message.input_image.image_url",
            "computer_call_output.output.image_url", "code_interpreter_call.outputs")
PART_TYPES = ("input_text", "output_text", "text")
# fields passed to the chat path unchanged (sampling, logit_bias, model, the acceptance rule)
PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "stop", "accept")
# chat-path parameter names -> the Responses request's
PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


@dataclass(frozen=True)
class ResponseRequest:
    """A checked Responses request: the chat body it runs as, and what its `response` object echoes."""

    chat: dict
    echo: dict = field(default_factory=dict)
    stream: bool = False


def _bad(message: str, param: str, code: str = "invalid_value") -> api.ApiError:
    return api.ApiError(message, param=param, code=code)


def _text(content: Any, param: str) -> str:
    """An input item's content as text: a string or an array of text parts (input_text / output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"'{param}' must be a string or an array of input_text parts", param, "invalid_type")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
        elif kind in PART_TYPES and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise _bad(f"only text parts ({', '.join(PART_TYPES)}) are supported in '{param}', got "
                       f"{json.dumps(kind)}", param, "unsupported_content")
    return "".join(parts)


def _call(item: dict, i: int) -> dict:
    name, args = item.get("name"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(item.get("call_id"), str) or not isinstance(args, str):
        raise _bad(f"input[{i}] (function_call) needs 'call_id', 'name' and 'arguments' (a JSON string)",
                   f"input[{i}]")
    return {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": args}}


def input_messages(items: Any, instructions: Any = None) -> list[dict]:
    """`instructions` and `input` as chat messages: function_call items join the assistant message before them
    (or start one), a function_call_output item is a tool message naming its call."""
    messages: list[dict] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("'instructions' must be a string", "instructions", "invalid_type")
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("'input' must be a string or a non-empty array of input items", "input")
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            messages.append({"role": item["role"], "content": _text(item.get("content", ""), f"input[{i}].content")})
        elif kind == "function_call":
            call = _call(item, i)
            names[call["id"]] = call["function"]["name"]
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad(f"input[{i}] (function_call_output) needs 'call_id'", f"input[{i}]")
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": call_id, "name": names.get(call_id, ""),
                             "content": output if isinstance(output, str) else _text(output, f"input[{i}].output")})
        elif kind != "reasoning":                  # this server writes none; a client may echo another's
            raise _bad(f"input[{i}]: items of type {json.dumps(kind)} are not supported (messages, function_call, "
                       "function_call_output)", f"input[{i}]", "unsupported_parameter")
    return messages


def _tools(body: dict) -> tuple[list[dict] | None, Any]:
    """(chat tools, chat tool_choice) of the request's function tools and tool_choice."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    chat_tools = None
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be an array of function tools", "tools", "invalid_type")
        chat_tools = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else t
                raise _bad(f"tools[{i}]: only function tools are supported, got {json.dumps(kind)}", "tools",
                           "unsupported_parameter")
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
            chat_tools.append({"type": "function", "function": fn})
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise _bad("'tool_choice' must be auto, none, required or {'type': 'function', 'name'}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return chat_tools or None, choice


def _format(body: dict) -> dict | None:
    """text.format -> response_format (json_schema's fields nest under json_schema)."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("'text' must be an object, e.g. {'format': {'type': 'json_schema', 'name', 'schema'}}", "text",
                   "invalid_type")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("'text.format' must be an object whose 'type' is text, json_object or json_schema", "text.format")
    if fmt.get("type") != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _logprobs(body: dict) -> dict:
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise _bad("'include' must be an array of strings", "include", "invalid_type")
    for i, x in enumerate(include):
        if x not in INCLUDES:
            raise _bad(f"include[{i}]: {json.dumps(x)} is not one of OpenAI's values ({', '.join(INCLUDES)})",
                       f"include[{i}]")
    if LOGPROBS_INCLUDE not in include:
        return {}
    return {"logprobs": True, "top_logprobs": body.get("top_logprobs") or 0}


def read_request(body: dict) -> ResponseRequest:
    """Check a Responses request and translate it into the chat body it runs as."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise _bad(f"'{name}' needs stored responses, which this server does not keep; send the whole "
                       "conversation as input items (with store: false)", name, "unsupported_parameter")
    if body.get("background"):
        raise _bad("'background' responses are not supported", "background", "unsupported_parameter")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream", "invalid_type")
    tools, choice = _tools(body)
    chat = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat.update(messages=input_messages(body.get("input"), body.get("instructions")), stream=stream,
                **_logprobs(body))
    for key, value in (("tools", tools), ("tool_choice", choice), ("response_format", _format(body)),
                       ("max_tokens", body.get("max_output_tokens")),
                       ("parallel_tool_calls", body.get("parallel_tool_calls"))):
        if value is not None:
            chat[key] = value
    echo = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "tools": [t for t in body.get("tools") or []], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "text": {"format": body.get("text", {}).get("format") or {"type": "text"}}
            if isinstance(body.get("text"), dict) else {"format": {"type": "text"}},
            "metadata": body.get("metadata") or {}, "top_logprobs": body.get("top_logprobs"),
            "user": body.get("user")}
    return ResponseRequest(chat, echo, stream)


def rename_error(err: api.ApiError) -> api.ApiError:
    """A chat-path error in the Responses request's terms (max_tokens -> max_output_tokens, ...)."""
    param = PARAMS.get((err.param or "").split("[")[0].split(".")[0], err.param)
    message = err.message.replace("'max_tokens'", "'max_output_tokens'").replace("max_tokens ", "max_output_tokens ")
    return api.ApiError(message, param, err.code, err.status, err.kind)


# ------------------------------------------------------------------------------------------ answers

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, logprobs: Sequence[dict] | None, status: str) -> dict:
    """An assistant message output item with one output_text part."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    """A function_call output item of a chat tool call ({"id", "function": {"name", "arguments"}})."""
    fn = call["function"]
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"], "status": status}


def usage(job: api.Job, choice: api.Choice) -> dict:
    prompt = len(job.prompts[0])
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": choice.stats.get("reused_tokens") or 0},
            "output_tokens": choice.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + choice.completion_tokens}


def status_of(choice: api.Choice) -> str:
    return "incomplete" if choice.finish_reason == "length" else "completed"


def response_object(req: ResponseRequest, job: api.Job, output: list[dict], status: str = "completed",
                    choice: api.Choice | None = None, queue_ms: float | None = None, error: dict | None = None) -> dict:
    """The `response` object: in_progress with no output and no usage (a stream's first events), else the
    finished one with its output items, usage and the specexec extension."""
    out = {"id": job.id, "object": "response", "created_at": job.created, "status": status, "error": error,
           "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
           "model": job.model, "output": output, "store": False, "truncation": "disabled",
           "reasoning": {"effort": None, "summary": None}, "previous_response_id": None, **req.echo,
           "usage": usage(job, choice) if choice is not None else None}
    if status in ("completed", "incomplete"):
        out["completed_at"] = int(time.time())
    if choice is not None and queue_ms is not None:
        out["specexec"] = api.extension([choice], queue_ms)
    return out


def output_items(choice: api.Choice, logprobs: bool) -> list[dict]:
    """A finished choice's output items: its message (when it has content or no call), then its calls."""
    items = []
    status = status_of(choice)
    if choice.text or not choice.tool_calls:
        items.append(message_item(new_id("msg"), choice.text, choice.logprobs if logprobs else None, status))
    items += [call_item(new_id("fc"), call) for call in choice.tool_calls]
    return items
