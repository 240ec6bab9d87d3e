"""The Responses API (POST /v1/responses) on loopback with the tiny pair whose template writes hermes tool calls,
driven by the official openai client's `responses.create` / `responses.stream` / `responses.parse` and by the
OpenAI Agents SDK in its Responses mode: text equal to the chat endpoint's for the same conversation, the event
stream in OpenAI's order with gapless sequence numbers, a forced call -> function_call_output -> answer round
trip, a named call streamed as function-call events, text.format json_schema through the grammar, log-probs, and
the request checks in the Responses API's own field names."""
from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from tests.serving.live_server import raw  # noqa: E402
from tests.serving.tool_models import TOOL_MODEL, TOOL_TOKENS  # noqa: E402

MODEL, TOKENS = TOOL_MODEL, TOOL_TOKENS
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
                          "required": ["city"], "additionalProperties": False}}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = pydantic.Field(ge=0, le=99)


def test_text_equals_the_chat_answer_and_streams_as_events(tool_client) -> None:
    kw = dict(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=24)
    r = tool_client.responses.create(**kw)
    chat = tool_client.chat.completions.create(model=MODEL, max_tokens=24, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert r.id.startswith("resp_") and r.object == "response" and r.instructions == "Be brief."
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    want = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert r.status == want and (r.incomplete_details is not None) == (want == "incomplete")
    assert r.model_extra["specexec"]["steps"] >= 1

    events = list(tool_client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == TEXT_EVENTS + ["response.output_text.delta"] * len(deltas) + TEXT_END + [f"response.{want}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in deltas) == r.output_text == events[-1].response.output_text
    assert len({e.item_id for e in deltas}) == 1 and events[-1].response.id == events[0].response.id


def test_the_sdk_stream_helper_accumulates_the_final_response(tool_client) -> None:
    with tool_client.responses.stream(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "Hello"}]}], max_output_tokens=TOKENS) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(texts)


def test_a_forced_call_round_trip_with_the_tool_output_fed_back(tool_client) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    r = tool_client.responses.create(model=MODEL, input=[question], tools=[WEATHER], tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=TOKENS)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo", "Lima")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    fed = [question, call.model_dump(exclude_none=True),
           {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    answer = tool_client.responses.create(model=MODEL, input=fed, tools=[WEATHER], tool_choice="none",
                                          max_output_tokens=8)
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    assert answer.usage.input_tokens > r.usage.input_tokens           # the call and its output were rendered


def test_a_named_call_streams_as_function_call_events(tool_client) -> None:
    kw = dict(model=MODEL, input="Weather?", tools=[WEATHER], max_output_tokens=TOKENS,
              tool_choice={"type": "function", "name": "get_weather"})
    whole = [item for item in tool_client.responses.create(**kw).output if item.type == "function_call"]
    events = list(tool_client.responses.create(stream=True, **kw))
    assert [e.type for e in events] == ["response.created", "response.in_progress"] + CALL_EVENTS + \
        ["response.completed"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert len(whole) == 1 and args == whole[0].arguments == events[-2].item.arguments
    assert events[2].item.arguments == "" and events[-2].item.status == "completed"
    assert [i.type for i in events[-1].response.output] == ["function_call"]


def test_text_format_json_schema_parses_like_the_chat_endpoint(tool_client) -> None:
    client, question = tool_client, "Describe a pet."
    r = client.responses.parse(model=MODEL, input=question, text_format=Pet, max_output_tokens=TOKENS)
    chat = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": question}],
                                         response_format=Pet, max_tokens=TOKENS)
    assert isinstance(r.output_parsed, Pet) and r.output_parsed == chat.choices[0].message.parsed
    assert r.model_extra["specexec"]["choices"][0]["grammar"]["target_rows"] > 0


def test_logprobs_come_with_the_include_flag(tool_client) -> None:
    kw = dict(model=MODEL, input="Hello", max_output_tokens=6)
    r = tool_client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, **kw)
    chat = tool_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=6, logprobs=True, top_logprobs=2)
    got = r.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(g.token, round(g.logprob, 5)) for g in got] == [(w.token, round(w.logprob, 5)) for w in want]
    assert all(len(g.top_logprobs) == 2 for g in got)
    assert tool_client.responses.create(**kw).output[0].content[0].logprobs == []


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format"),
    ({"input": "x", "model": "other"}, "model")])
def test_bad_requests_name_the_responses_field(tool_url, body: dict, param: str) -> None:
    status, reply = raw(tool_url, "POST", "/v1/responses", body)
    assert status in (400, 404) and reply["error"]["param"] == param, reply


def test_the_openai_agents_sdk_runs_a_tool_agent_in_responses_mode(tool_url, weather_agent) -> None:
    agents = weather_agent.agents

    async def run() -> tuple[str, str]:
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
            base_url=tool_url + "/v1", api_key="unused", max_retries=0, timeout=120))
        settings = agents.ModelSettings(tool_choice="get_weather", parallel_tool_calls=False, max_tokens=TOKENS)
        agent = weather_agent.agent(model, settings)
        whole = await agents.Runner.run(agent, "What is the weather in Oslo?")
        streamed = agents.Runner.run_streamed(agent, "And in Lima?")
        kinds = {e.type async for e in streamed.stream_events()}
        assert "raw_response_event" in kinds
        return whole.final_output, streamed.final_output

    whole, streamed = asyncio.run(run())
    seen = weather_agent.seen
    assert len(seen) == 2 and (whole, streamed) == tuple(f"It is sunny in {city}." for city in seen)
