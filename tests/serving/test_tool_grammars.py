"""Forced tool calls in GLM's and gpt-oss's harmony formats: the grammar (specexec/serving/tool_grammars.py) takes
the calls these families write (with and without their reasoning, the envelope as special tokens or as plain
text) and stops one whose arguments leave the schema; on loopback, a tiny model whose tokenizer has the family's
envelope as special tokens answers tool_choice "required" and a named function (streamed) with calls that parse
and validate, through the official openai client."""
from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
llguidance = pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

from transformers import AutoTokenizer  # noqa: E402

from specexec.config import EngineConfig  # noqa: E402
from specexec.runtime.assembly import Runtime  # noqa: E402
from specexec.runtime.grammar import Grammars  # noqa: E402
from specexec.serving import tools  # noqa: E402
from tests.serving.live_server import served  # noqa: E402
from tests.serving.tool_models import SPECIAL, with_special_tokens  # noqa: E402

TOKENS = 96
CITIES = ["Paris", "Oslo", "Lima"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": CITIES}, "note": {"type": "string"},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "note"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}

GLM_CALL = ("<think>The user wants <b>weather</b>.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Paris</arg_value>\n<arg_key>note</arg_key>\n<arg_value>a <b> c</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather: {city}.<|end|><|start|>assistant<|channel|>"
                'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Lima", "note": "x"}')
# (format, a call it writes, that call parsed, the same call with an argument outside the schema)
CASES = [
    ("glm", GLM_CALL, ("get_weather", {"city": "Paris", "note": "a <b> c", "days": 3}),
     GLM_CALL.replace("<arg_value>3<", "<arg_value>12<")),
    ("glm", GLM_CALL.split("</think>")[1], ("get_weather", {"city": "Paris", "note": "a <b> c", "days": 3}),
     GLM_CALL.split("</think>")[1].replace("Paris", "Rome")),
    ("harmony", HARMONY_CALL, ("get_weather", {"city": "Lima", "note": "x"}),
     HARMONY_CALL.replace('"note": "x"', '"note": 4')),
    ("harmony", HARMONY_CALL[HARMONY_CALL.index("assistant") + 9:], ("get_weather", {"city": "Lima", "note": "x"}),
     HARMONY_CALL.replace("Lima", "Rome")),
]


@pytest.fixture(scope="module", params=["special", "text"])
def tokenizer(request, tiny_pair):
    """tiny_pair's tokenizer, with every format's envelope as added special tokens or left as plain text."""
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    if request.param == "special":
        tok.add_special_tokens({"additional_special_tokens": [t for ts in SPECIAL.values() for t in ts]})
    return tok


def _consumed(grammars: Grammars, grammar: str, text: str, tok) -> tuple[int, int, bool]:
    """(tokens the grammar takes, tokens of `text`, whether it is complete there)."""
    ids = tok.encode(text, add_special_tokens=False)
    matcher = llguidance.LLMatcher(grammars.view(), grammar, log_level=0)
    return matcher.try_consume_tokens(ids), len(ids), matcher.is_accepting()


@pytest.mark.parametrize("fmt,text,call,bad", CASES, ids=["glm-thinking", "glm", "harmony-analysis", "harmony"])
def test_the_forced_grammar_takes_the_familys_call_and_stops_a_bad_argument(tokenizer, fmt, text, call, bad) -> None:
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    request = tools.parse_tools({"tools": [WEATHER, CLOCK], "tool_choice": "required"})
    grammar = grammars.lark(tools.forced_grammar(tools.by_name(fmt), request, tokenizer))
    grammars.check(grammar)
    took, total, complete = _consumed(grammars, grammar, text, tokenizer)
    assert took == total and complete
    _, calls = tools.by_name(fmt).parse(text)
    assert [(name, json.loads(args)) for name, args in calls] == [call]
    took, total, complete = _consumed(grammars, grammar, bad, tokenizer)
    assert took < total and not complete


def test_a_named_function_is_the_only_call_the_grammar_takes(tokenizer) -> None:
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    named = tools.parse_tools({"tools": [WEATHER, CLOCK], "tool_choice": {"type": "function",
                                                                          "function": {"name": "get_time"}}})
    for fmt, text in (("glm", GLM_CALL), ("harmony", HARMONY_CALL)):
        grammar = grammars.lark(tools.forced_grammar(tools.by_name(fmt), named, tokenizer))
        assert _consumed(grammars, grammar, text, tokenizer)[0] < len(tokenizer.encode(text, add_special_tokens=False))
    glm = "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>-3</arg_value>\n</tool_call>"
    grammar = grammars.lark(tools.forced_grammar(tools.by_name("glm"), named, tokenizer))
    assert _consumed(grammars, grammar, glm, tokenizer)[2]


def test_glm_content_leaves_out_the_reasoning() -> None:
    content, calls = tools.by_name("glm").parse("<think>hmm</think>Checking.\n<tool_call>get_time\n"
                                                "<arg_key>zone</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
    assert content == "Checking." and calls == [("get_time", '{"zone": 2}')]


# ------------------------------------------------------------------------------------------ on loopback

@pytest.fixture(scope="module", params=["glm", "harmony"])
def served_format(request, tiny_pair, tiny_perturbed_draft, tiny_root) -> Iterator[tuple[str, openai.OpenAI, dict]]:
    """A tiny pair whose tokenizer and template are the format's, served; (format, client, logit_bias that
    ends every free-text span the moment the grammar allows: a random model otherwise writes on)."""
    fmt = request.param
    target = with_special_tokens(tiny_root / f"pair-target-{fmt}", tiny_pair[0], fmt, seed=31)
    draft = with_special_tokens(tiny_root / f"pair-draft-{fmt}", tiny_perturbed_draft, fmt, seed=32)
    runtime = Runtime.load(str(target), str(draft), EngineConfig(budget=16, dtype="float32", max_new_tokens=TOKENS))
    closers = ("</think>", "</arg_value>") if fmt == "glm" else ("<|end|>",)
    bias = {str(runtime.tokenizer.convert_tokens_to_ids(t)): 100 for t in closers}
    with served(runtime, f"tiny-{fmt}", TOKENS) as (_, client):
        yield fmt, client, bias


def _valid(name: str, args: str) -> bool:
    a = json.loads(args)
    if name == "get_time":
        return set(a) == {"zone"} and isinstance(a["zone"], int) and -12 <= a["zone"] <= 14
    days_ok = "days" not in a or (isinstance(a["days"], int) and 1 <= a["days"] <= 9)
    return name == "get_weather" and a["city"] in CITIES and isinstance(a["note"], str) and days_ok


def test_required_and_named_calls_parse_and_validate(served_format) -> None:
    fmt, client, bias = served_format
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    r = client.chat.completions.create(model=f"tiny-{fmt}", messages=messages, tools=[WEATHER, CLOCK],
                                       tool_choice="required", logit_bias=bias)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert all(_valid(c.function.name, c.function.arguments) for c in choice.message.tool_calls)
    assert r.model_extra["specexec"]["choices"][0]["grammar"]["target_rows"] > 0

    stream = client.chat.completions.create(model=f"tiny-{fmt}", messages=messages, tools=[WEATHER, CLOCK],
                                            tool_choice={"type": "function", "function": {"name": "get_time"}},
                                            logit_bias=bias, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "get_time" and _valid("get_time", calls[0].function.arguments)
