"""A chat request's conversation: `messages` checked and put in the form the model's chat template takes
(text content; an assistant's tool_calls with their arguments as objects; a tool message's tool_call_id, which
must name a call of the assistant message before it, as OpenAI requires), and
encoded to prompt ids through that template, with the request's tools when it has some.

Does not know: HTTP, sampling fields (specexec/serving/openai_api.py), tool formats (specexec/serving/tools.py).
"""
from __future__ import annotations

import json
from typing import Any

from specexec.options import ConfigError
from specexec.runtime.tokenizer import encode_messages
from specexec.serving.openai_api import ApiError
from specexec.serving.tools import chat_message

ROLES = ("system", "developer", "user", "assistant", "tool")


def _content_text(content: Any, index: int) -> str:
    """A message's content as text: a string, null, or an array of {"type": "text", "text"} parts."""
    param = f"messages[{index}].content"
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError("only text content parts ({'type': 'text', 'text': ...}) are supported",
                               param=param, code="unsupported_content")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(f"'{param}' must be a string or an array of text parts", param=param, code="invalid_type")


def parse_messages(body: dict) -> list[dict]:
    """[{"role", "content", ...}] with text content; 'developer' is the system role under another name; an
    assistant's tool_calls and a tool message's tool_call_id are kept for the template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty array of {'role', 'content'} objects", param="messages",
                       code="invalid_value")
    out = []
    calls: list | None = None               # the ids of the tool calls the tool messages here may answer
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(f"messages[{i}] must be an object whose 'role' is one of {', '.join(ROLES)}",
                           param=f"messages[{i}]", code="invalid_value")
        role = "system" if m["role"] == "developer" else m["role"]
        if role == "tool":
            _check_answer(m, i, calls)
        elif role == "assistant" and m.get("tool_calls"):
            calls = [c.get("id") for c in m["tool_calls"] if isinstance(c, dict)] if isinstance(
                m["tool_calls"], list) else []
        else:
            calls = None
        out.append(chat_message({**m, "role": role, "content": _content_text(m.get("content"), i)}, i))
    return out


def _check_answer(m: dict, i: int, calls: list | None) -> None:
    """A tool message answers one call of the assistant message before it (tool messages between), as OpenAI
    requires: a 400 otherwise."""
    if calls is None:
        raise ApiError(f"messages[{i}]: a message with role 'tool' must answer a preceding assistant message with "
                       "'tool_calls'", param=f"messages[{i}].role", code="invalid_value")
    if m.get("tool_call_id") not in calls:
        raise ApiError(f"messages[{i}].tool_call_id {json.dumps(m.get('tool_call_id'))} matches no call of the "
                       f"assistant message before it (its calls: {', '.join(map(json.dumps, calls)) or 'none'})",
                       param=f"messages[{i}].tool_call_id", code="invalid_value")


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Prompt ids of a conversation (and tools) through the model's chat template; a refusal is a 400."""
    try:
        return encode_messages(tokenizer, messages, tools=tools)
    except ConfigError as e:
        raise ApiError(str(e), param="messages", code="invalid_value") from None
    except Exception as e:                  # noqa: BLE001 -- jinja's TemplateError, raise_exception(), ...
        raise ApiError(f"the model's chat template rejected the messages: {e}", param="messages",
                       code="invalid_value") from None
