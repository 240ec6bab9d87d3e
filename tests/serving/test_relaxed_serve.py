"""--accept relaxed through `specexec serve`: the request's "accept" field (else the server's --accept) decides,
and every response says which in system_fingerprint (streamed chunks too); a bad value is a 400 naming "accept"."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
openai = pytest.importorskip("openai")

import specexec  # noqa: E402
from cli.serve.app import build_app  # noqa: E402
from specexec.config import Acceptance, EngineConfig, SamplingParams  # noqa: E402
from specexec.runtime.assembly import Runtime  # noqa: E402
from specexec.serving.openai_api import ServerDefaults  # noqa: E402
from tests.serving.live_server import running  # noqa: E402

MODEL, TOKENS = "tiny", 12
EXACT_PRINT = f"specexec-{specexec.__version__}-exact"


@pytest.fixture(scope="module")
def client(tiny_pair, tiny_perturbed_draft) -> Iterator[openai.OpenAI]:
    runtime = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft),
                           EngineConfig(budget=8, dtype="float32", max_new_tokens=TOKENS))
    with running(build_app(runtime, ServerDefaults(MODEL, SamplingParams(), TOKENS))) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def ask(client, **extra):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=TOKENS, extra_body=extra or None)


def test_the_fingerprint_says_how_tokens_were_accepted(client) -> None:
    exact = ask(client)
    zero = ask(client, accept="relaxed:delta=0,k=8")
    loose = ask(client, accept="relaxed:delta=0.7,k=40")
    assert exact.system_fingerprint == EXACT_PRINT
    assert zero.system_fingerprint == f"specexec-{specexec.__version__}-relaxed-d0-k8"
    assert loose.system_fingerprint == f"specexec-{specexec.__version__}-relaxed-d0.7-k40"
    assert zero.choices[0].message.content == exact.choices[0].message.content      # delta = 0 is exact
    stats = loose.model_extra["specexec"]["choices"][0]
    assert (stats["accept"], stats["delta"], stats["k"]) == ("relaxed", 0.7, 40) and "relaxed_tokens" in stats
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, stream=True, extra_body={"accept": "relaxed"}))
    assert {c.system_fingerprint for c in chunks} == {f"specexec-{specexec.__version__}-relaxed-d0.1-k10"}


def test_the_servers_default_and_bad_values(client, tiny_pair, tiny_perturbed_draft) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, accept="relaxed:delta=3")
    assert info.value.body["param"] == "accept" and "delta must be in [0.0, 1.0]" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, accept="relaxed:k=320")
    assert info.value.body["param"] == "accept" and "above the target's vocabulary" in info.value.body["message"]
    runtime = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft),
                           EngineConfig(budget=8, dtype="float32", max_new_tokens=TOKENS,
                                        accept=Acceptance.parse("relaxed:delta=0.2")))
    defaults = ServerDefaults(MODEL, SamplingParams(), TOKENS, accept=runtime.config.accept)
    with running(build_app(runtime, defaults)) as base:
        other = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert ask(other).system_fingerprint.endswith("-relaxed-d0.2-k10")
        assert ask(other, accept="exact").system_fingerprint == EXACT_PRINT
