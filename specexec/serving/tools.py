"""Tool calls of the OpenAI chat API in the model's own format: the request's tools and tool_choice, the
format the model writes its calls in (read from its chat template), the text -> tool_calls parse, the grammar
that forces a call, and the stream of a choice's text as content and tool-call deltas.

`parse_tools` checks `tools` (functions with a JSON-schema `parameters`), `tool_choice` ("auto", "none",
"required", or {"type": "function", "function": {"name"}}) and `parallel_tool_calls`. The tools go into the
chat template (the model's own rendering of them), with "none" too (its answer is then not parsed).

Formats (`FORMATS`, picked by a marker in the chat template; a template with tools but no known marker is one
400): "hermes" (Qwen 2.5/3 and others: <tool_call>{"name", "arguments"}</tool_call>), "llama3" (Llama 3.1-3.3:
a JSON object {"name", "parameters"} after an optional <|python_tag|>), "mistral" ([TOOL_CALLS] followed by a
JSON array of {"name", "arguments"}, or name[ARGS]{...}), "glm" (GLM-4.5+: <tool_call>name then
<arg_key>k</arg_key><arg_value>v</arg_value> pairs) and "harmony" (gpt-oss: to=functions.NAME ...
<|message|>{args}<|call|>, read from the text with special tokens kept). With "required" or a named function,
the answer is generated under a grammar of the format's envelope around the functions' argument schemas
(specexec/serving/tool_grammars.py; it masks the draft and the target, specexec/constraint.py), so the call
parses and its arguments validate.

Does not know: HTTP, the engine, how the grammar is compiled (specexec/runtime/grammar.py).
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from specexec.serving import tool_grammars as grammars
from specexec.serving.openai_api import ApiError, Choice

CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolRequest:
    """The tools of one request: OpenAI tool objects, the choice ("auto" | "none" | "required" | "named"),
    the named function, whether several calls may come in one answer."""

    tools: tuple[dict, ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def functions(self) -> list[dict]:
        """The functions a call may name (the named one alone, when one is named)."""
        fns = [t["function"] for t in self.tools]
        return [f for f in fns if f["name"] == self.name] if self.choice == "named" else fns


def _bad(message: str, param: str = "tools") -> ApiError:
    return ApiError(message, param=param, code="invalid_value")


def _function(tool: object, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
            tool.get("function"), dict):
        raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", fn["name"]):
        raise _bad(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise _bad(f"tools[{i}].function.parameters must be a JSON schema object")
    if params and params.get("type") != "object":           # OpenAI's rule: the arguments are one JSON object
        got = f"type: {json.dumps(params['type'])}" if "type" in params else f"no type ({', '.join(sorted(params))})"
        raise _bad(f"tools[{i}].function.parameters of {fn['name']!r} must be a JSON schema of type 'object' "
                   f"(got {got}): a call's arguments are a JSON object")
    return {"type": "function", "function": {**fn, "parameters": params}}


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools, checked; None without tools (a tool_choice alone is then a 400 unless 'none')."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise _bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array of function tools")
    checked = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if choice is None or choice in CHOICES:
        return ToolRequest(checked, choice or "auto", None, parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
        raise _bad(f"'tool_choice' must be one of {', '.join(CHOICES)} or {{'type': 'function', 'function': "
                   f"{{'name': one of {', '.join(names)}}}}}", "tool_choice")
    return ToolRequest(checked, "named", name, parallel)


def chat_message(m: dict, i: int) -> dict:
    """The template's form of an assistant message with tool_calls (arguments as objects) or a tool message."""
    out = {"role": m["role"], "content": m.get("content") or ""}
    if m["role"] == "tool":
        out["tool_call_id"] = m.get("tool_call_id") or ""
        if m.get("name"):
            out["name"] = m["name"]
    calls = m.get("tool_calls") or []
    if m["role"] == "assistant" and calls:
        if not isinstance(calls, list):
            raise _bad(f"messages[{i}].tool_calls must be an array", "messages")
        out["tool_calls"] = [_template_call(c, i) for c in calls]
    return out


def _template_call(call: object, i: int) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(f"messages[{i}].tool_calls entries must be {{'function': {{'name', 'arguments'}}}}", "messages")
    args = fn.get("arguments") or "{}"
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass                                   # a template renders the string as it is
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


# ------------------------------------------------------------------------------------------ formats

Call = tuple[str, str]                         # (function name, arguments as JSON text)


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes tool calls: the template marker that names it, where a call starts in the text
    (content before it streams as it comes), the parse of a whole answer, the grammar of forced calls."""

    name: str
    marker: str
    start: str
    parse: Callable[[str], tuple[str, list[Call]]]
    grammar: Callable[[list[dict], bool, Callable[[str], str]], str]
    special: tuple[str, ...] = field(default=())    # text the answer must keep special tokens for


def _args(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _json_calls(blobs: list[str], key: str = "arguments") -> list[Call] | None:
    calls = []
    for blob in blobs:
        try:
            obj = json.loads(blob)
        except json.JSONDecodeError:
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            calls.append((item["name"], _args(item.get(key, item.get("arguments", item.get("parameters", {}))))))
    return calls


def _complete(blocks: list[tuple[str, str]]) -> list[str]:
    """The bodies of (body, closing tag) blocks, less a last one cut off (no closing tag) after complete ones:
    an answer cut at max_tokens keeps the calls it finished."""
    if len(blocks) > 1 and not blocks[-1][1]:
        blocks = blocks[:-1]
    return [body for body, _ in blocks]


def _parse_hermes(text: str) -> tuple[str, list[Call]]:
    blobs = _complete(re.findall(r"<tool_call>\s*(.*?)\s*(</tool_call>|$)", text, re.S))
    calls = _json_calls(blobs) if blobs else []
    if calls is None:
        return text, []
    return re.sub(r"<tool_call>.*?(?:</tool_call>|$)", "", text, flags=re.S).strip(), calls


def _parse_llama3(text: str) -> tuple[str, list[Call]]:
    body = text.replace("<|python_tag|>", "").strip()
    if not body.startswith("{"):
        return text, []
    calls = _json_calls([p for p in re.split(r"\s*;\s*(?=\{)", body) if p], "parameters")
    return ("", calls) if calls else (text, [])


def _parse_mistral(text: str) -> tuple[str, list[Call]]:
    head, sep, rest = text.partition("[TOOL_CALLS]")
    if not sep:
        return text, []
    rest = rest.strip()
    if rest.startswith("["):
        calls = _json_calls([rest]) or _json_calls(_array_items(rest))
    else:                                      # name[ARGS]{...} (newer Mistral templates)
        calls = [(n, a) for n, a in re.findall(r"([A-Za-z0-9_.\-]+)\[ARGS\](\{.*?\})(?=\s*(?:\[TOOL_CALLS\]|$))",
                                               rest, re.S)]
    return (head.strip(), calls) if calls else (text, [])


def _array_items(text: str) -> list[str]:
    """The complete items of a JSON array cut off after some ('[{...}, {...}, {"na'), each as JSON text."""
    decoder, items, at = json.JSONDecoder(), [], 1
    while True:
        at = len(text) - len(text[at:].lstrip(" \n,"))
        try:
            item, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return items
        items.append(json.dumps(item, ensure_ascii=False))
        at = end


def _glm_value(v: str) -> object:
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def _parse_glm(text: str) -> tuple[str, list[Call]]:
    calls = []
    for block in _complete(re.findall(r"<tool_call>(.*?)(</tool_call>|$)", text, re.S)):
        name, _, rest = block.strip().partition("\n")
        pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", rest, re.S)
        if not name.strip():
            return text, []
        calls.append((name.strip(), json.dumps({k.strip(): _glm_value(v) for k, v in pairs}, ensure_ascii=False)))
    content = re.sub(r"<think>.*?(?:</think>|$)|<tool_call>.*?(?:</tool_call>|$)", "", text, flags=re.S)
    return content.strip(), calls


def _parse_harmony(text: str) -> tuple[str, list[Call]]:
    pattern = r"to=functions\.([A-Za-z0-9_.\-]+)[^<]*(?:<\|constrain\|>\s*\w+\s*)?<\|message\|>(.*?)(?:<\|call\|>|$)"
    calls = [(name, args.strip()) for name, args in re.findall(pattern, text, re.S)]
    final = re.findall(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", text, re.S)
    content = final[-1].strip() if final else ("" if calls else text)
    return content, calls


FORMATS = (
    ToolFormat("glm", "<arg_key>", "<tool_call>", _parse_glm, grammars.glm, ("<tool_call>", "</tool_call>")),
    ToolFormat("harmony", "<|channel|>", "<|start|>", _parse_harmony, grammars.harmony, ("<|channel|>",)),
    ToolFormat("hermes", "<tool_call>", "<tool_call>", _parse_hermes, grammars.hermes),
    ToolFormat("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", _parse_mistral, grammars.mistral),
    ToolFormat("llama3", "<|python_tag|>", "{", _parse_llama3, grammars.llama3),
)


def format_for(template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template writes (None: no template, or no format known)."""
    if not template or "tools" not in template:
        return None
    return next((f for f in FORMATS if f.marker in template), None)


def require_format(template: str | None) -> ToolFormat:
    """The format for a request with tools; a 400 when the template has none known."""
    fmt = format_for(template)
    if fmt is None:
        raise ApiError("this model's chat template has no tool-call format specexec knows (hermes <tool_call>, "
                       "llama3 JSON, mistral [TOOL_CALLS], glm <arg_key>, gpt-oss harmony); send the request "
                       "without 'tools'", param="tools", code="unsupported_tool_format")
    return fmt


def by_name(name: str) -> ToolFormat:
    return next(f for f in FORMATS if f.name == name)


def literal(tokenizer, text: str) -> str:
    """`text` in a Lark grammar: the special-token reference when the tokenizer has it as one added token
    (llguidance matches added tokens only so), else a quoted string."""
    added = getattr(tokenizer, "get_added_vocab", dict)()
    return text if text in added else json.dumps(text)


def forced_grammar(fmt: ToolFormat, request: ToolRequest, tokenizer) -> str:
    """The Lark text of a forced call (required / named): the format's envelope around each function's
    arguments schema."""
    return fmt.grammar(request.functions(), request.parallel, lambda t: literal(tokenizer, t))


def answer_text(fmt: ToolFormat, text: str, ids: tuple[int, ...], tokenizer) -> str:
    """What a whole answer is parsed from: its text, or its ids (less a final end-of-sequence token) decoded
    with special tokens kept when the format writes its calls in them."""
    if not fmt.special:
        return text
    ids = list(ids)
    if ids and ids[-1] == getattr(tokenizer, "eos_token_id", None):      # the end, not part of a call
        ids.pop()
    return tokenizer.decode(ids, skip_special_tokens=False)


def finish_calls(c: Choice, split: "ToolStream", tokenizer) -> str:
    """Split a finished choice's answer into content and tool_calls (finish_reason tool_calls when it has
    some); -> the content `split` has not sent yet."""
    rest, calls = split.finish(answer_text(split.fmt, c.text, c.ids, tokenizer))
    if calls:
        c.tool_calls, c.finish_reason = tool_calls(calls), "tool_calls"
    return rest


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_calls(calls: list[Call]) -> list[dict]:
    """OpenAI `message.tool_calls` of parsed calls."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]


class ToolStream:
    """A choice's streamed text split into content (sent as it comes, up to where a call may start) and tool
    calls (each sent whole when the answer ends). feed(text) -> new content; finish() -> (content, calls)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt, self.text, self.sent = fmt, "", 0

    def feed(self, text: str) -> str:
        self.text += text
        if self.fmt.special:                           # calls live in special tokens: the whole answer waits
            return ""
        start = self.text.find(self.fmt.start)
        safe = start if start >= 0 else max(len(self.text) - len(self.fmt.start) + 1, 0)
        if self.fmt.name == "llama3":                  # a call is the whole answer: nothing streams before it
            safe = 0 if self.text.lstrip()[:1] in ("", "{", "<") else len(self.text)
        new = self.text[self.sent:max(safe, self.sent)]
        self.sent = max(safe, self.sent)
        return new

    def finish(self, whole: str | None = None) -> tuple[str, list[Call]]:
        """The rest of the content (not yet sent) and the calls the answer holds; `whole`: the text to parse
        instead of the streamed one (answer_text)."""
        content, calls = self.fmt.parse(self.text if whole is None else whole)
        if not calls:
            return self.text[self.sent:], []
        return content[self.sent:] if content.startswith(self.text[:self.sent]) else "", calls
