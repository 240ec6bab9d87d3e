"""Bad input that used to reach an internal error, or pass where OpenAI refuses it, through `specexec serve`
(issue 55), on loopback with the tiny hermes-template pair (conftest.tool_server): a schema beyond the grammar library's limits is a 400 naming the
limit before anything is generated (chat and Responses, streamed or not, response formats and forced tool
calls), and a limit met only while generating ends the answer cleanly (finish_reason "length", the library's
message in the `specexec` extension), never a 500; a tool's parameters that are not an object schema, a tool
message that answers no call before it, a `text` that is not an object and an unknown `include` in Responses
are 400s, as OpenAI answers them. A forced call list cut by max_tokens keeps the calls it finished; the forced
hermes grammar ends after any complete call (a newline may come first) and allows one call with
parallel_tool_calls false. Grammars compile on a pool of their own (a plain request does not wait behind them;
the access log's wait counts a request's wait for a grammar thread); a schema over the size cap is a 400."""
from __future__ import annotations

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("llguidance")

from tests.serving.live_server import raw  # noqa: E402
from tests.serving.tool_models import TOOL_MODEL  # noqa: E402

RECURSIVE = {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}
LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
WIDE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
PATTERN = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
           "required": ["s"]}
BEYOND = {"recursive": (RECURSIVE, "Too many items"), "a $ref loop": (LOOP, "admits no value"),
          "1,000 optional properties": (WIDE, "max is 2000")}
USER = [{"role": "user", "content": "Answer."}]


def chat_body(schema: dict, stream: bool) -> dict:
    return {"model": TOOL_MODEL, "messages": USER, "max_tokens": 8, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def tool_body(schema: dict, stream: bool) -> dict:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return {"model": TOOL_MODEL, "messages": USER, "max_tokens": 8, "stream": stream, "tools": [tool],
            "tool_choice": "required"}


def responses_body(schema: dict, stream: bool) -> dict:
    return {"model": TOOL_MODEL, "input": "Answer.", "max_output_tokens": 8, "stream": stream,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", BEYOND)
def test_a_schema_beyond_the_librarys_limits_is_a_400_naming_the_limit(tool_url, name: str, stream: bool) -> None:
    schema, limit = BEYOND[name]
    for path, body, param in (("/v1/chat/completions", chat_body(schema, stream), "response_format"),
                              ("/v1/responses", responses_body(schema, stream), "text.format")):
        status, reply = raw(tool_url, "POST", path, body)
        assert status == 400, (path, reply)
        message = reply["error"]["message"]
        assert "beyond the grammar library's limits" in message and limit in message, message
        assert reply["error"]["param"] == param and "\n" not in message
    if name == "recursive":                  # an object schema (a $ref loop is not; 1,000 properties overflow
                                             # the tiny model's context as tools in the prompt)
        status, reply = raw(tool_url, "POST", "/v1/chat/completions", tool_body(schema, stream))
        assert status == 400 and reply["error"]["param"] == "tools" and limit in reply["error"]["message"], reply


@pytest.mark.slow
def test_a_pattern_beyond_the_lexers_limits_is_a_400(tool_url) -> None:
    """(a{1000}){1000}: llguidance's first mask spends seconds before its lexer gives up."""
    status, reply = raw(tool_url, "POST", "/v1/chat/completions", chat_body(PATTERN, False))
    assert status == 400 and "lexer error: too many expressions" in reply["error"]["message"], reply


def test_a_limit_met_while_generating_ends_the_answer_cleanly(tool_url) -> None:
    """The first property is free text, so the check passes; the 1,000-property object after it is beyond
    the library: the answer stops before it with finish_reason "length" and the library's message."""
    schema = {"type": "object", "properties": {"first_property_name": {"type": "string", "maxLength": 12},
                                               "b": WIDE},
              "required": ["first_property_name", "b"], "additionalProperties": False}
    status, reply = raw(tool_url, "POST", "/v1/chat/completions", {**chat_body(schema, False), "max_tokens": 96})
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith('{"first_property_name')
    assert reply["usage"]["completion_tokens"] < 96
    assert "max is 2000" in reply["specexec"]["choices"][0]["grammar"]["limit"]


@pytest.mark.parametrize("params", [{"enum": ["a", "b"]}, {"type": "string"}, {"type": "array", "items": {}},
                                    [{"type": "object"}]], ids=["enum", "string", "array", "a list"])
def test_a_tools_parameters_must_be_an_object_schema(tool_url, params) -> None:
    chat = {**tool_body({}, False), "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]}
    status, reply = raw(tool_url, "POST", "/v1/chat/completions", chat)
    assert status == 400 and reply["error"]["param"] == "tools", reply
    assert "object" in reply["error"]["message"]
    body = {"model": TOOL_MODEL, "input": "x", "tools": [{"type": "function", "name": "f", "parameters": params}],
            "tool_choice": "required"}
    status, reply = raw(tool_url, "POST", "/v1/responses", body)
    assert status == 400 and reply["error"]["param"] == "tools", reply


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("messages,param", [
    ([{"role": "tool", "tool_call_id": "call_1", "content": "x"}, *USER], "messages[0].role"),
    ([*USER, {"role": "tool", "tool_call_id": "call_1", "content": "x"}], "messages[1].role"),
    ([*USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_2", "content": "x"}],
     "messages[2].tool_call_id"),
    ([*USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1", "content": "x"},
      *USER, {"role": "tool", "tool_call_id": "call_1", "content": "x"}], "messages[4].role")],
    ids=["tool first", "no call before", "no matching id", "after a user turn"])
def test_a_tool_message_must_answer_a_call_before_it(tool_url, messages: list, param: str) -> None:
    status, reply = raw(tool_url, "POST", "/v1/chat/completions",
                        {"model": TOOL_MODEL, "messages": messages, "max_tokens": 2})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_a_tool_message_answering_its_call_passes(tool_url) -> None:
    messages = [*USER, {"role": "assistant", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
                {"role": "tool", "tool_call_id": "call_2", "content": "x"},
                {"role": "tool", "tool_call_id": "call_1", "content": "y"}]
    status, reply = raw(tool_url, "POST", "/v1/chat/completions",
                        {"model": TOOL_MODEL, "messages": messages, "max_tokens": 2})
    assert status == 200, reply


@pytest.mark.parametrize("extra,param", [
    ({"text": "json"}, "text"), ({"include": ["message.output_text.everything"]}, "include[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input")],
    ids=["text as a string", "unknown include", "an output with no call"])
def test_responses_is_as_strict_as_openai(tool_url, extra: dict, param: str) -> None:
    status, reply = raw(tool_url, "POST", "/v1/responses", {"model": TOOL_MODEL, "input": "x", **extra})
    assert status == 400 and reply["error"]["param"] == param, reply
    include = ["reasoning.encrypted_content", "message.output_text.logprobs"]     # OpenAI's: accepted
    status, reply = raw(tool_url, "POST", "/v1/responses", {"model": TOOL_MODEL, "input": "x", "include": include,
                                                            "max_output_tokens": 2})
    assert status == 200, reply


# ------------------------------------------------------------------------------------------ forced call lists

HERMES_CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


@pytest.mark.parametrize("fmt,text,calls", [
    ("hermes", f"{HERMES_CALL}\n{HERMES_CALL}\n<tool_call>\n{{\"name\": \"f\", \"argu", [("f", '{"a": 1}')] * 2),
    ("glm", "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>\n<tool_call>f\n"
            "<arg_key>a</arg_key>\n<arg_val", [("f", '{"a": 1}')]),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "f", "arguments": {"a": 2}}, {"na',
     [("f", '{"a": 1}'), ("f", '{"a": 2}')])], ids=["hermes", "glm", "mistral"])
def test_an_answer_cut_inside_a_call_keeps_the_calls_it_finished(fmt: str, text: str, calls: list) -> None:
    """max_tokens cutting the model's third call had dropped every call (tool_calls [] and the markup left in
    the content); the finished ones are the answer's calls, the cut one is neither call nor content."""
    from specexec.serving import tools

    content, got = tools.by_name(fmt).parse(text)
    assert got == calls and content == ""


def test_a_forced_hermes_list_may_end_after_any_complete_call_and_parallel_false_allows_one(tool_runtime) -> None:
    """The model's end after a call (with or without a newline) ends the list; parallel_tool_calls false: the
    grammar allows exactly one call."""
    import llguidance

    from specexec.serving import tools

    tok, grammars = tool_runtime.tokenizer, tool_runtime.grammars
    fn = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}

    def takes(parallel: bool, text: str) -> tuple[bool, bool]:
        request = tools.parse_tools({"tools": [fn], "tool_choice": "required", "parallel_tool_calls": parallel})
        grammar = grammars.lark(tools.forced_grammar(tools.by_name("hermes"), request, tok))
        matcher = llguidance.LLMatcher(grammars.view(), grammar, log_level=0)
        ids = tok.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids), matcher.is_accepting()

    assert takes(True, HERMES_CALL) == (True, True)
    assert takes(True, HERMES_CALL + "\n") == (True, True)                  # the model's newline, then its end
    assert takes(True, f"{HERMES_CALL}\n{HERMES_CALL}\n") == (True, True)
    assert takes(False, HERMES_CALL + "\n") == (True, True)
    assert takes(False, f"{HERMES_CALL}\n{HERMES_CALL}")[0] is False          # one call, no second


# ------------------------------------------------------------------------------------------ grammar compiles

def test_grammar_compiles_leave_the_tokenizing_thread_and_the_log_shows_their_wait(tool_runtime, monkeypatch) -> None:
    """Three schemas whose compile takes 3 s each on a pool of two grammar threads: a plain request sent after
    them is answered before any compile ends (it had waited behind them on the one tokenizing thread), and the
    access log's wait shows the third schema's wait for a grammar thread (it had shown the worker's only)."""
    import threading
    import time

    from cli.serve import app as serve_app
    from specexec.config import SamplingParams
    from specexec.serving.openai_api import ServerDefaults
    from tests.serving.live_server import running

    from specexec.serving import structured

    compile_s = 3.0
    real = structured.response_grammar

    def slow(body, grammars):
        if body.get("response_format"):
            time.sleep(compile_s)
        return real(body, grammars)
    monkeypatch.setattr(structured, "response_grammar", slow)
    lines: list[str] = []
    app = serve_app.build_app(tool_runtime, ServerDefaults(TOOL_MODEL, SamplingParams(), 4),
                              serve_app.ServeSettings(access_log=lines.append, grammar_threads=2))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with running(app) as url:
        asked = [threading.Thread(target=raw, args=(url, "POST", "/v1/chat/completions",
                                                    {**chat_body(schema, False), "max_tokens": 2}, None, 60))
                 for _ in range(3)]
        for t in asked:
            t.start()
        time.sleep(0.5)
        t0 = time.perf_counter()
        status, reply = raw(url, "POST", "/v1/chat/completions",
                            {"model": TOOL_MODEL, "messages": USER, "max_tokens": 2})
        plain_s = time.perf_counter() - t0
        for t in asked:
            t.join()
    assert status == 200 and plain_s < compile_s - 0.5, plain_s
    waits = sorted(float(line.split("wait=")[1].split("s")[0]) for line in lines if "tokens=2 " in line)
    assert len(lines) == 4 and waits[-1] >= compile_s - 1.0, lines


def test_a_schema_over_the_size_cap_is_a_400_before_compiling(tool_url) -> None:
    """10,000 properties (the issue's schema: seconds of compile each) are refused on their size alone."""
    huge = {"type": "object", "properties": {f"property_{i}": {"type": "integer"} for i in range(10_000)}}
    status, reply = raw(tool_url, "POST", "/v1/chat/completions", chat_body(huge, False))
    assert status == 400 and reply["error"]["param"] == "response_format", reply
    assert "characters long, over the 256,000 this server compiles" in reply["error"]["message"]
