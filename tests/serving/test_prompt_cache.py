"""`--prompt-cache` through `specexec serve`: two conversations alternating each find their own prefix again
(OpenAI's usage.prompt_tokens_details.cached_tokens, Anthropic's cache_read_input_tokens), with the answers of
a server without the cache; a restarted server (a new app and a new cache over the same directory) finds the
first conversation's prefix on disk, and so do the seats of a --parallel 2 server; `--prompt-cache` with a bad
size is one line."""
from __future__ import annotations

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from cli.serve.app import ServeSettings, build_app  # noqa: E402
from specexec.config import SamplingParams  # noqa: E402
from specexec.runtime import prompt_cache  # noqa: E402
from specexec.serving.openai_api import ServerDefaults  # noqa: E402
from tests.serving.live_server import running  # noqa: E402
from tests.serving.tool_models import TOOL_MODEL  # noqa: E402

SYSTEM = "You are a careful assistant. " * 12


def _ask(base: str, who: str, turn: int) -> tuple[str, int, str, int]:
    """(openai answer, its cached tokens, anthropic answer, its cache reads) of one turn of `who`."""
    messages = [{"role": "user", "content": f"{who} asks question {t}"} for t in range(turn + 1)]
    oa = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    r = oa.chat.completions.create(model=TOOL_MODEL, max_tokens=4, temperature=0,
                                   messages=[{"role": "system", "content": who + SYSTEM}, *messages])
    an = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=60)
    m = an.messages.create(model=TOOL_MODEL, max_tokens=4, system=who + SYSTEM, messages=messages,
                           extra_body={"temperature": 0})
    oa.close(), an.close()
    return (r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens, m.content[0].text,
            m.usage.cache_read_input_tokens)


def test_alternating_conversations_and_a_restart_find_their_prefix(tool_runtime, tmp_path) -> None:
    defaults = ServerDefaults(TOOL_MODEL, SamplingParams(), 4)
    with running(build_app(tool_runtime, defaults)) as base:
        plain = [_ask(base, who, 1) for who in ("Ann", "Bob")]
    try:
        cache = prompt_cache.attach(tool_runtime, 2**30, tmp_path)
        cache.block = 16
        with running(build_app(tool_runtime, defaults)) as base:
            for who in ("Ann", "Bob"):
                _ask(base, who, 0)
            turns = [_ask(base, who, 1) for who in ("Ann", "Bob")]
        for (text, cached, text2, reads), (want, _, want2, _) in zip(turns, plain):
            assert text == want and text2 == want2
            assert cached >= len(SYSTEM) // 2 and reads >= len(SYSTEM) // 2, (cached, reads)
        prompt_cache.attach(tool_runtime, 2**30, tmp_path).block = 16       # a restarted server
        with running(build_app(tool_runtime, defaults)) as base:
            _ask(base, "Cid", 0)                                            # the engine's own cache moves on
            text, cached, _, _ = _ask(base, "Ann", 1)
        assert text == plain[0][0] and cached >= len(SYSTEM) // 2
        with running(build_app(tool_runtime, defaults, ServeSettings(parallel=2))) as base:   # seats share it
            _ask(base, "Cid", 0)
            text, cached, _, _ = _ask(base, "Bob", 1)
        assert text == plain[1][0] and cached >= len(SYSTEM) // 2
    finally:
        tool_runtime.engine.prefix_cache = None


def test_a_bad_size_is_one_line(capsys, tiny_pair) -> None:
    from cli.main import main

    assert main(["serve", "--model", str(tiny_pair[0]), "--no-draft", "--port", "0",
                 "--prompt-cache", "lots"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--prompt-cache" in err[0] and "not a size" in err[0], err
