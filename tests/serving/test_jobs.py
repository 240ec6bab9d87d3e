"""specexec/serving/jobs.py: a request's body -> its Job without HTTP: a forced tool call's grammar wins over
response_format's, the tool-call format is the chat template's, a completion carries response_format's grammar;
`admit` refuses what the run cannot take, each refusal an ApiError naming the request's parameter by the
refusal's subject (n, temperature, accept), never by reading its message."""
from __future__ import annotations

from dataclasses import replace

import pytest

from specexec.config import Acceptance, SamplingParams
from specexec.options import about
from specexec.serving import openai_api as api
from specexec.serving.jobs import JobMaker

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
    "type": "object", "properties": {"zebra_field": {"type": "integer"}}, "required": ["zebra_field"]}}}


@pytest.fixture(scope="module")
def maker(tool_runtime) -> JobMaker:
    return JobMaker(tool_runtime, api.ServerDefaults("m"), tool_runtime.target_info.args.vocab_size)


def test_a_forced_tool_call_s_grammar_wins_over_response_format(maker) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER],
            "tool_choice": "required", "response_format": SCHEMA}
    job = maker.chat(body)
    assert job.tool_format == "hermes" and "get_weather" in job.grammar and "zebra_field" not in job.grammar
    free = maker.chat({**body, "tool_choice": "none"})
    assert free.tool_format is None and "zebra_field" in free.grammar          # no call wanted: the schema's
    text = maker.completion({"model": "m", "prompt": "hi", "response_format": SCHEMA, "max_tokens": 4})
    assert text.kind == "text" and "zebra_field" in text.grammar


def test_each_refusal_names_its_parameter(maker) -> None:
    job = maker.completion({"model": "m", "prompt": "hi", "max_tokens": 4})
    with pytest.raises(api.ApiError) as e:
        maker.admit(job, max_choices=0)
    assert e.value.param == "n"
    with pytest.raises(api.ApiError) as e:
        maker.admit(replace(job, accept=Acceptance("relaxed", 0.1, 10**6)), max_choices=8)
    assert e.value.param == "accept" and "above the target's vocabulary" in e.value.message

    class Refusing:
        def rule_for(self, sampling: SamplingParams, accept: Acceptance):
            raise about("--verifier", "rrs_wor", "a message that happens to say --accept")
    other = JobMaker(replace_engine(maker.runtime, Refusing()), maker.defaults, maker.vocab_size)
    with pytest.raises(api.ApiError) as e:
        other.admit(job, max_choices=8)
    assert e.value.param == "temperature"                   # by the subject, not by the words


def replace_engine(runtime, engine):
    class View:
        def __getattr__(self, name: str):
            return engine if name == "engine" else getattr(runtime, name)
    return View()
