"""The Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) on loopback with the tiny pair whose
template writes hermes tool calls, driven by the official `anthropic` SDK: a text answer equal to the chat
endpoint's for the same conversation, the event stream in Anthropic's order, a forced call (tool_choice tool and
any, under the grammar) -> tool_result -> answer round trip, a call streamed as a tool_use block, stop_sequences,
count_tokens, errors in Anthropic's shape naming this API's fields, and the key sent as x-api-key."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("llguidance")
anthropic = pytest.importorskip("anthropic")

from tests.serving.live_server import raw  # noqa: E402
from tests.serving.tool_models import TOOL_MODEL, TOOL_TOKENS  # noqa: E402

MODEL, TOKENS = TOOL_MODEL, TOOL_TOKENS
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
                            "required": ["city"], "additionalProperties": False}}
TEXT_EVENTS = ["message_start", "content_block_start"]          # the SDK's iterator drops ping events
END_EVENTS = ["content_block_stop", "message_delta", "message_stop"]


@pytest.fixture(scope="module")
def claude(tool_server):
    client = anthropic.Anthropic(base_url=tool_server[0], api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()


def test_text_equals_the_chat_answer_and_streams_as_events(claude, tool_client) -> None:
    kw = dict(model=MODEL, max_tokens=24, system=[{"type": "text", "text": "Be brief."}],
              messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
              metadata={"user_id": "u1"}, extra_body={"temperature": 0.0})
    m = claude.messages.create(**kw)
    chat = tool_client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0.0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens and m.model_extra["specexec"]["steps"] >= 1

    events = list(claude.messages.create(stream=True, **kw))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert kinds == TEXT_EVENTS + ["content_block_delta"] * len(deltas) + END_EVENTS
    assert "".join(e.delta.text for e in deltas) == m.content[0].text
    assert events[0].message.id.startswith("msg_") and events[0].message.content == []
    assert events[-2].delta.stop_reason == m.stop_reason and events[-2].usage.output_tokens == m.usage.output_tokens

    with claude.messages.stream(**kw) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason


def test_a_forced_call_round_trip_with_the_tool_result_fed_back(claude) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}
    m = claude.messages.create(model=MODEL, max_tokens=TOKENS, messages=[question], tools=[WEATHER],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    calls = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Oslo", "Lima")
    assert call.id.startswith("toolu_")
    fed = [question, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                         "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=8, messages=fed, tools=[WEATHER],
                                    tool_choice={"type": "none"})
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason in ("end_turn", "max_tokens")
    grown = answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert grown > m.usage.input_tokens + m.usage.cache_read_input_tokens      # the call and its result rendered
    counted = claude.messages.count_tokens(model=MODEL, messages=fed, tools=[WEATHER])
    assert counted.input_tokens == grown


def test_a_named_call_streams_as_a_tool_use_block(claude) -> None:
    kw = dict(model=MODEL, max_tokens=TOKENS, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"})
    whole = [b for b in claude.messages.create(**kw).content if b.type == "tool_use"]
    events = list(claude.messages.create(stream=True, **kw))
    assert [e.type for e in events] == ["message_start", "content_block_start", "content_block_delta",
                                        "content_block_stop", "message_delta", "message_stop"]
    start, delta = events[1], events[2]
    assert start.content_block.type == "tool_use" and start.content_block.input == {}
    assert len(whole) == 1 and json.loads(delta.delta.partial_json) == whole[0].input
    assert events[-2].delta.stop_reason == "tool_use"
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", whole[0].input)]


def test_stop_sequences_end_the_text_and_are_reported(claude) -> None:
    kw = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Hello"}],
              extra_body={"temperature": 0.0})
    text = claude.messages.create(**kw).content[0].text
    stop = next((text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip() and
                 text[i:i + 2] not in text[:i + 1]), None)
    assert stop is not None, text
    m = claude.messages.create(stop_sequences=["\x00never", stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]
    events = list(claude.messages.create(stream=True, stop_sequences=[stop], **kw))
    assert events[-2].delta.stop_reason == "stop_sequence" and events[-2].delta.stop_sequence == stop


@pytest.mark.parametrize("body,status,kind,words", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "Hi"}]}, 400, "invalid_request_error", "'system'"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", '"image"'),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "web_search_20250305",
                                                                                   "name": "w"}]},
     400, "invalid_request_error", "client tools"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "stop_sequences": ["x"] * 40}, 400,
     "invalid_request_error", "stop_sequences"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"type": "sometimes"}}, 400,
     "invalid_request_error", "tool_choice"),
    ({"model": "claude-nope", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}, 404,
     "not_found_error", "claude-nope"),
])
def test_bad_requests_get_anthropic_error_bodies(tool_url, body: dict, status: int, kind: str, words: str) -> None:
    code, reply = raw(tool_url, "POST", "/v1/messages", {"model": MODEL, **body})
    assert code == status and reply["type"] == "error" and reply["error"]["type"] == kind, reply
    assert words in reply["error"]["message"], reply


def test_the_sdk_raises_its_own_errors(claude) -> None:
    with pytest.raises(anthropic.NotFoundError, match="claude-nope"):
        claude.messages.create(model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(anthropic.BadRequestError, match="not supported"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])


def test_the_key_is_accepted_as_x_api_key(tool_runtime) -> None:
    from cli.serve.app import ServeSettings, build_app
    from specexec.config import SamplingParams
    from specexec.serving.openai_api import ServerDefaults
    from tests.serving.live_server import running

    app = build_app(tool_runtime, ServerDefaults(MODEL, SamplingParams(), 4), ServeSettings(api_key="s3cret"))
    hi = dict(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    with running(app) as base:
        code, reply = raw(base, "POST", "/v1/messages", hi, {"x-api-key": "wrong"})
        assert code == 401 and reply["error"]["type"] == "authentication_error", reply
        code, reply = raw(base, "POST", "/v1/messages", hi, {"x-api-key": "s3cret"})     # as Claude Code sends it
        assert code == 200 and reply["type"] == "message", reply
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(**hi)
        good = anthropic.Anthropic(base_url=base, api_key="s3cret", max_retries=0, timeout=60)
        assert good.messages.create(**hi).usage.output_tokens >= 1
        bearer = anthropic.Anthropic(base_url=base, auth_token="s3cret", max_retries=0, timeout=60)
        assert bearer.messages.count_tokens(model=MODEL, messages=hi["messages"]).input_tokens > 0
        good.close(), bearer.close()


def test_the_raw_stream_pings_after_message_start_and_output_config_follows_its_schema(tool_url) -> None:
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    code, text = raw(tool_url, "POST", "/v1/messages", body)
    kinds = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("event: ")]
    assert code == 200 and kinds[:2] == ["message_start", "ping"] and kinds[-1] == "message_stop", text
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"],
              "additionalProperties": False}
    code, m = raw(tool_url, "POST", "/v1/messages", {
        "model": MODEL, "max_tokens": 40, "messages": [{"role": "user", "content": "A pet?"}],
        "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert code == 200 and json.loads(m["content"][0]["text"])["kind"] in ("cat", "dog"), m
