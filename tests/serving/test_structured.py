"""Structured output through `specexec serve` with the official openai client: chat.completions.parse with a
pydantic model (json_schema) returns a parsed, valid object whose ids are the constrained target alone's, with
the grammar's counters in the `specexec` extension; JSON mode gives an object; a schema llguidance refuses is a
400 naming response_format."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from specexec.config import EngineConfig, SamplingParams  # noqa: E402
from specexec.runtime.assembly import Runtime  # noqa: E402
from tests.serving.live_server import raw, served  # noqa: E402

MODEL, TOKENS = "tiny", 96


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = pydantic.Field(ge=0, le=99)
    name: str = pydantic.Field(max_length=6)


@pytest.fixture(scope="module")
def runtime(tiny_pair, tiny_perturbed_draft) -> Runtime:
    return Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft),
                        EngineConfig(budget=16, dtype="float32", max_new_tokens=TOKENS))


@pytest.fixture(scope="module")
def server(runtime) -> Iterator[tuple[str, openai.OpenAI]]:
    with served(runtime, MODEL, TOKENS) as pair:
        yield pair


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[0]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server[1]


def test_parse_with_a_pydantic_model_is_the_constrained_target_alone(client, runtime) -> None:
    messages = [{"role": "user", "content": "Describe a pet."}]
    r = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Pet, max_tokens=TOKENS)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and r.choices[0].finish_reason == "stop"
    schema = openai.lib._pydantic.to_strict_json_schema(Pet)
    alone = runtime.variant(runtime.config, use_draft=False)
    constraint = alone.grammars.constraint(alone.grammars.json_schema(schema))
    ids = runtime.encode("Describe a pet.", chat=True)
    want = [t for s in alone.generate_ids(ids, TOKENS, SamplingParams(), constraint=constraint) for t in s]
    assert r.choices[0].message.content == runtime.tokenizer.decode(want, skip_special_tokens=True)
    ext = r.model_extra["specexec"]
    grammar = ext["choices"][0]["grammar"]
    assert grammar["dead"] == 0 and grammar["draft_rows"] > 0 and grammar["target_rows"] >= ext["steps"]
    assert ext["tokens_per_step"] > 1


def test_json_mode_gives_an_object_and_streams(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                       response_format={"type": "json_object"}, max_tokens=TOKENS)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                            response_format={"type": "json_object"}, max_tokens=TOKENS, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_bad_response_formats_are_400s(url) -> None:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    for fmt in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
                {"type": "json_schema"}, {"type": "yaml"}, "json"):
        code, reply = raw(url, "POST", "/v1/chat/completions", {**base, "response_format": fmt})
        assert code == 400 and reply["error"]["param"] == "response_format", (fmt, reply)
