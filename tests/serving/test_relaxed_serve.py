"""--accept relaxed through `specexec serve`: the request's "accept" field (else the server's --accept) decides,
and every response says which in system_fingerprint (streamed chunks too); a bad value is a 400 naming "accept",
and so is a k above the run's one neighbour table (--accept's k, else the default: what its plan counts)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
openai = pytest.importorskip("openai")

import specexec  # noqa: E402
from cli.serve.app import build_app  # noqa: E402
from specexec.acceptance.parsing import parse as parse_acceptance  # noqa: E402
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
    loose = ask(client, accept="relaxed:delta=0.7,k=10")
    assert exact.system_fingerprint == EXACT_PRINT
    assert zero.system_fingerprint == f"specexec-{specexec.__version__}-relaxed-d0-k8"
    assert loose.system_fingerprint == f"specexec-{specexec.__version__}-relaxed-d0.7-k10"
    assert zero.choices[0].message.content == exact.choices[0].message.content      # delta = 0 is exact
    stats = loose.model_extra["specexec"]["choices"][0]
    assert (stats["accept"], stats["delta"], stats["k"]) == ("relaxed", 0.7, 10) and "relaxed_tokens" in stats
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
    for k in (11, 300):                    # above the run's one table (the default k: its --accept is exact)
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, accept=f"relaxed:k={k}")
        message = info.value.body["message"]
        assert info.value.body["param"] == "accept" and "above the 10 neighbours per token this run's table " \
            "holds" in message and "a request may lower k, not raise it" in message
    runtime = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft),
                           EngineConfig(budget=8, dtype="float32", max_new_tokens=TOKENS,
                                        accept=parse_acceptance("relaxed:delta=0.2,k=40")))
    defaults = ServerDefaults(MODEL, SamplingParams(), TOKENS, accept=runtime.config.accept)
    with running(build_app(runtime, defaults)) as base:
        other = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert ask(other).system_fingerprint.endswith("-relaxed-d0.2-k40")
        assert ask(other, accept="relaxed:delta=0.5,k=7").system_fingerprint.endswith("-relaxed-d0.5-k7")
        assert ask(other, accept="exact").system_fingerprint == EXACT_PRINT
        with pytest.raises(openai.BadRequestError):
            ask(other, accept="relaxed:k=41")
    neighbours = runtime.engine.neighbours                   # one table, at the run's k, for every lower k
    assert neighbours.k == 40 and neighbours.made == neighbours.bytes_for(40) == 320 * (4 * 40 + 1)
