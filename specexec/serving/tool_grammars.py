"""The Lark grammars (llguidance's dialect) that force a tool call in a model's own format: each takes the
functions a call may name, whether several calls may come, and `token` (a piece of the envelope -> its
reference: a special token's `<name>` when the tokenizer has it as one added token, else a quoted string).

- hermes: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one or more (one: parallel false).
- llama3: one JSON object {"name": ..., "parameters": {...}}.
- mistral: [TOOL_CALLS] and a JSON array of {"name", "arguments"}.
- glm: an optional <think>...</think>, then <tool_call>NAME\\n (after an optional newline) and one
  <arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n pair per argument, in the schema's property order (the
  required ones always, the others optional), then </tool_call>. A value is written as GLM's template writes
  it: a string raw (an enum's strings as alternatives, any other string as free text up to </arg_value>),
  anything else as JSON under its schema.
- harmony (gpt-oss): an optional analysis message (<|channel|>analysis<|message|>...<|end|><|start|>assistant),
  then <|channel|>commentary to=functions.NAME <|constrain|>json<|message|> and the arguments' JSON; the model's
  end-of-sequence (<|call|>) then ends the answer. One call per answer (harmony stops at each call).

Every JSON part is on one line with json.dumps' separators, as the templates render arguments. After a complete
call the grammar is complete (hermes and glm: a newline may follow), so the model's end-of-sequence token ends
the list where the model stops; with parallel false one call is all the grammar allows.

Does not know: parsing answers (specexec/serving/tools.py), compiling grammars (specexec/runtime/grammar.py).
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable

from specexec.runtime.grammar import JSON_STYLE

Token = Callable[[str], str]


def _json(schema: dict) -> str:
    """%json of `schema`, on one line."""
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_STYLE})}"


def call_schema(functions: list[dict], key: str) -> dict:
    """A JSON schema of one call to any of `functions`: {"name": const, key: its parameters}."""
    options = [{"type": "object", "properties": {"name": {"const": f["name"]}, key: f["parameters"]},
                "required": ["name", key], "additionalProperties": False} for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _free_text_until(close: str, rule: str) -> tuple[str, str]:
    """(expression, extra rules) of any text ending with the envelope piece `close` (already `token`ed): a
    special token can never occur inside the text, a plain string ends the text lazily at its first
    occurrence."""
    if not close.startswith('"'):
        return f"/(?s:.*)/ {close}", ""
    end = re.escape(json.loads(close)).replace("/", "\\/")
    return rule, f"{rule}[lazy]: /(?s:.*){end}/\n"


def hermes(functions: list[dict], parallel: bool, token: Token) -> str:
    call = f'{token("<tool_call>")} "\\n" {_json(call_schema(functions, "arguments"))} "\\n" ' \
           f'{token("</tool_call>")}'
    more = ' ("\\n" call)*' if parallel else ""
    return f'start: call{more} "\\n"?\ncall: {call}\n'            # a newline may come before the end


def llama3(functions: list[dict], parallel: bool, token: Token) -> str:
    return f'start: {_json(call_schema(functions, "parameters"))}\n'


def mistral(functions: list[dict], parallel: bool, token: Token) -> str:
    schema = {"type": "array", "items": call_schema(functions, "arguments"), "minItems": 1,
              **({} if parallel else {"maxItems": 1})}
    return f'start: {token("[TOOL_CALLS]")} " "? {_json(schema)}\n'


# ------------------------------------------------------------------------------------------ glm

def _glm_value(schema: object, close: str, rule: str) -> tuple[str, str]:
    """(expression, extra rules) of one argument's value as GLM's template writes it."""
    schema = schema if isinstance(schema, dict) else {}
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values:
        written = [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in values]
        return "(" + " | ".join(json.dumps(w) for w in written) + f") {close}", ""
    if schema.get("type") == "string":
        return _free_text_until(close, rule)
    return f"{_json(schema)} {close}", ""


def _glm_function(fn: dict, i: int, token: Token) -> str:
    """The rules of a call to one function: fn{i} and one rule per argument."""
    params = fn["parameters"]
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    pairs, rules = [], ""
    for j, (key, schema) in enumerate(props.items()):
        value, extra = _glm_value(schema, token("</arg_value>"), f"text{i}_{j}")
        rules += extra + f'arg{i}_{j}: {token("<arg_key>")} {json.dumps(key)} {token("</arg_key>")} "\\n" ' \
                         f'{token("<arg_value>")} {value} "\\n"\n'
        pairs.append(f"arg{i}_{j}" + ("" if key in required else "?"))
    body = " ".join(pairs)
    return rules + f'fn{i}: {json.dumps(fn["name"])} "\\n" {body} {token("</tool_call>")}\n'


def glm(functions: list[dict], parallel: bool, token: Token) -> str:
    think, think_rules = _free_text_until(token("</think>"), "thought")
    rules = "".join(_glm_function(fn, i, token) for i, fn in enumerate(functions))
    names = " | ".join(f"fn{i}" for i in range(len(functions)))
    more = "+" if parallel else ""
    return (f'start: "\\n"? reasoning? ("\\n"? call){more} "\\n"?\n'
            f'reasoning: {token("<think>")} {think}\n{think_rules}'
            f'call: {token("<tool_call>")} ({names})\n{rules}')


# ------------------------------------------------------------------------------------------ harmony

def harmony(functions: list[dict], parallel: bool, token: Token) -> str:
    channel, message = token("<|channel|>"), token("<|message|>")
    analysis, analysis_rules = _free_text_until(token("<|end|>"), "thought")
    calls = " | ".join(f'{json.dumps(f["name"] + " ")} {token("<|constrain|>")} "json" {message} '
                       f'{_json(f["parameters"])}' for f in functions)
    return (f'start: reasoning? {channel} "commentary to=functions." ({calls})\n'
            f'reasoning: {channel} "analysis" {message} {analysis} {token("<|start|>")} "assistant"\n'
            f"{analysis_rules}")
