"""Tool calls through `specexec serve`: the formats' parsers on written answers (hermes, llama3, mistral, glm,
harmony), request checks, and on loopback with a tiny model whose template writes hermes calls: the official
openai client's round trip (a forced call, the tool's answer fed back, a reply), streamed tool-call deltas, one
400 for a template without a known format, and the OpenAI Agents SDK driving the server end to end through a
call the grammar forces."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

from cli.serve.app import build_app  # noqa: E402
from specexec.config import EngineConfig, SamplingParams  # noqa: E402
from specexec.runtime.assembly import Runtime  # noqa: E402
from specexec.serving import tools  # noqa: E402
from specexec.serving.openai_api import ApiError, ServerDefaults  # noqa: E402
from tests.serving.live_server import raw, running  # noqa: E402
from tests.serving.tool_models import HERMES_TEMPLATE, TOOL_MODEL, TOOL_TOKENS  # noqa: E402

MODEL, TOKENS = TOOL_MODEL, TOOL_TOKENS
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                                                 "maximum": 14}},
                                       "required": ["zone"], "additionalProperties": False}}}


# ------------------------------------------------------------------------------------------ parsers

def test_each_format_parses_its_calls_and_keeps_the_content() -> None:
    hermes = tools.by_name("hermes").parse
    assert hermes('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
                  '{"name": "g", "arguments": {}}\n</tool_call>') == ("Sure.", [("f", '{"a": 1}'), ("g", "{}")])
    assert hermes("no call here") == ("no call here", [])
    assert hermes("<tool_call>\n{not json}\n</tool_call>")[1] == []             # never a wrong parse
    llama = tools.by_name("llama3").parse
    assert llama('<|python_tag|>{"name": "f", "parameters": {"x": "y"}}') == ("", [("f", '{"x": "y"}')])
    assert llama('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"k": 2}}')[1] == \
        [("f", "{}"), ("g", '{"k": 2}')]
    assert llama("Hello {there}")[1] == []
    mistral = tools.by_name("mistral").parse
    assert mistral('[TOOL_CALLS] [{"name": "f", "arguments": {"q": 1}}]') == ("", [("f", '{"q": 1}')])
    assert mistral('[TOOL_CALLS]f[ARGS]{"q": 1}') == ("", [("f", '{"q": 1}')])
    glm = tools.by_name("glm").parse
    assert glm("Ok<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
               "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>") == \
        ("Ok", [("get_weather", '{"city": "Paris", "days": 3}')])
    harmony = tools.by_name("harmony").parse
    assert harmony('<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary '
                   'to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>') == \
        ("", [("get_weather", '{"city":"Oslo"}')])


def test_a_stream_sends_content_until_a_call_may_start() -> None:
    split = tools.ToolStream(tools.by_name("hermes"))
    assert split.feed("Let me check") == "Let me che" or split.text == "Let me check"
    sent = split.text[:split.sent] + split.feed(" <tool_call>\n{\"name\": \"f\", \"arguments\": {}}")
    rest, calls = split.finish()
    assert (sent + rest).strip() == "Let me check" and calls == [("f", "{}")]


def test_formats_come_from_the_template_and_unknown_ones_are_one_400() -> None:
    assert tools.format_for(HERMES_TEMPLATE).name == "hermes"
    assert tools.format_for("{{ messages }}") is None and tools.format_for(None) is None
    with pytest.raises(ApiError, match="no tool-call format") as e:
        tools.require_format("{% if tools %}{{ tools }}{% endif %}")
    assert e.value.status == 400 and e.value.param == "tools"
    assert tools.require_format("{% if tools %}<arg_key>{% endif %}").name == "glm"


@pytest.mark.parametrize("body,param", [
    ({"tools": "x"}, "tools"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"), ({"tools": [WEATHER], "parallel_tool_calls": 1},
                                                   "parallel_tool_calls")])
def test_bad_tool_requests(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        tools.parse_tools(body)
    assert e.value.param == param


# ------------------------------------------------------------------------------------------ live

def test_openai_round_trip_call_tool_message_answer(tool_client) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = tool_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=TOKENS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, set(args)) in (("get_weather", {"city"}), ("get_time", {"zone"}))
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = tool_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                                 tool_choice="none", max_tokens=8)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    assert answer.usage.prompt_tokens > r.usage.prompt_tokens                 # the call and result were rendered


def test_a_named_call_streams_as_tool_call_deltas(tool_client) -> None:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER, TIME],
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=TOKENS)
    whole = tool_client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in tool_client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0] == {"name": "get_weather", "arguments": whole.function.arguments}
    assert json.loads(whole.function.arguments)["city"] in ("Paris", "Oslo", "Lima")


def test_tools_on_a_template_without_a_known_format_are_one_400(tiny_pair, tiny_perturbed_draft) -> None:
    plain = Runtime.load(str(tiny_pair[0]), None, EngineConfig(dtype="float32", max_new_tokens=8))
    with running(build_app(plain, ServerDefaults(MODEL, SamplingParams(), 8))) as base:
        code, reply = raw(base, "POST", "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]})
    assert code == 400 and reply["error"]["code"] == "unsupported_tool_format"


def test_the_openai_agents_sdk_runs_an_agent_through_a_forced_tool_call(tool_url, weather_agent) -> None:
    agents = weather_agent.agents
    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=tool_url + "/v1", api_key="unused", max_retries=0, timeout=120))
    agent = weather_agent.agent(model, agents.ModelSettings(tool_choice="get_weather", max_tokens=TOKENS))
    result = agents.Runner.run_sync(agent, "What is the weather in Oslo?")
    seen = weather_agent.seen
    assert len(seen) == 1, result.raw_responses
    assert result.final_output == f"It is sunny in {seen[0]}."
