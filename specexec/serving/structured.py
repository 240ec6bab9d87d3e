"""Structured output of the OpenAI API: `response_format` -> the grammar a generation runs under.

{"type": "text"} (or none): no grammar. {"type": "json_object"}: any JSON object (JSON mode).
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}: JSON valid against the schema (`strict`
is accepted either way: the grammar always holds the output to the schema). The grammar masks the draft's tree
and the target's logits alike (specexec/constraint.py), so the answer is the constrained target's; a schema
llguidance cannot compile is a 400 naming the problem.

Does not know: HTTP, tokenizers (specexec/runtime/grammar.py compiles the grammar), tool calls
(specexec/serving/tools.py).
"""
from __future__ import annotations

from specexec.options import ConfigError
from specexec.runtime.grammar import Grammars
from specexec.serving.openai_api import ApiError

FORMATS = ("text", "json_object", "json_schema")


def response_schema(body: dict) -> tuple[bool, dict | None]:
    """(whether the answer must be JSON, its schema or None for any object) from `response_format`."""
    fmt = body.get("response_format")
    if fmt is None:
        return False, None
    if not isinstance(fmt, dict) or fmt.get("type") not in FORMATS:
        raise ApiError(f"'response_format' must be an object whose 'type' is one of {', '.join(FORMATS)}",
                       param="response_format", code="invalid_value")
    if fmt["type"] == "text":
        return False, None
    if fmt["type"] == "json_object":
        return True, None
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ApiError("'response_format.json_schema.schema' must be a JSON schema object",
                       param="response_format", code="invalid_value")
    return True, schema


def schema_grammar(grammars: Grammars, schema: dict | None, param: str = "response_format") -> str:
    """The checked grammar of a schema; a 400 naming `param` when llguidance refuses it."""
    try:
        grammar = grammars.json_schema(schema)
        grammars.check(grammar)
    except ConfigError as e:
        raise ApiError(str(e), param=param, code="invalid_value") from None
    return grammar


def response_grammar(body: dict, grammars: Grammars) -> str | None:
    """The grammar `response_format` asks for, checked (None: free text)."""
    wants_json, schema = response_schema(body)
    return schema_grammar(grammars, schema) if wants_json else None

