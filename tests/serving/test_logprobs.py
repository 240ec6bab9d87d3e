"""logprobs / top_logprobs and logit_bias through `specexec serve` with the official openai client: the values
are the target's own processed distribution (equal to the target-alone run's within fp32 rounding), streamed
chunks carry their tokens' entries, /v1/completions gets the legacy object, and logit_bias moves draft and
target alike so the output stays the target-alone output under the same bias."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
openai = pytest.importorskip("openai")

from specexec.config import EngineConfig, SamplingParams  # noqa: E402
from specexec.generation import TokenLogprob  # noqa: E402
from specexec.runtime.assembly import Runtime  # noqa: E402
from specexec.sampling import apply_logit_bias  # noqa: E402
from specexec.serving import logprobs as lp  # noqa: E402
from tests.serving.live_server import served  # noqa: E402

MODEL, TOKENS = "tiny", 24


@pytest.fixture(scope="module")
def runtime(tiny_pair, tiny_perturbed_draft) -> Runtime:
    return Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft),
                        EngineConfig(budget=8, dtype="float32", max_new_tokens=TOKENS))


@pytest.fixture(scope="module")
def client(runtime) -> Iterator[openai.OpenAI]:
    with served(runtime, MODEL, TOKENS) as (_, client):
        yield client


def alone(runtime: Runtime, content: str, sampling: SamplingParams, top: int) -> list[TokenLogprob]:
    """The target alone (no draft) on the same chat prompt: its tokens' log-probs."""
    solo = runtime.variant(runtime.config, use_draft=False)
    ids = runtime.encode(content, chat=True)
    for _ in solo.generate_ids(ids, TOKENS, sampling, logprobs=top):
        pass
    return solo.engine.logprobs


def test_chat_logprobs_are_the_target_alone_values(client, runtime) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                       logprobs=True, top_logprobs=3, max_tokens=TOKENS)
    content = r.choices[0].logprobs.content
    ref = alone(runtime, "Hello", SamplingParams(), 3)
    assert r.model_extra["specexec"]["tokens_per_step"] > 1          # the draft ran: values came from trees
    assert len(content) == r.usage.completion_tokens == len(ref)
    for entry, want in zip(content, ref):
        assert entry.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([x for _, x in want.top], abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6       # greedy: the chosen one is the best
        assert entry.token == runtime.tokenizer.decode([want.token])
    text = bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace")
    assert text == r.choices[0].message.content                 # a token's bytes, not its lone decode, add up


def test_streamed_chunks_carry_their_tokens_logprobs(client) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           logprobs=True, max_tokens=TOKENS)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            logprobs=True, max_tokens=TOKENS, stream=True)
    entries, text = [], ""
    for chunk in stream:
        choice = chunk.choices[0]
        if choice.delta.content:
            text += choice.delta.content
            entries += choice.logprobs.content
    assert text == whole.choices[0].message.content
    assert [e.logprob for e in entries] == [e.logprob for e in whole.choices[0].logprobs.content]
    assert all(e.top_logprobs == [] for e in entries)


def test_completions_legacy_logprobs_and_none_by_default(client) -> None:
    r = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=8, logprobs=2)
    got = r.choices[0].logprobs
    assert len(got.tokens) == len(got.token_logprobs) == len(got.top_logprobs) == r.usage.completion_tokens
    assert all(len(top) <= 2 for top in got.top_logprobs) and got.text_offset[0] == 0
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_logit_bias_moves_both_models_and_stays_exact(client, runtime) -> None:
    banned = alone(runtime, "Hello", SamplingParams(), 0)[0].token        # the target's first choice
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                       max_tokens=TOKENS, logprobs=True, logit_bias={str(banned): -100, "50": 8})
    ref = alone(runtime, "Hello", SamplingParams(logit_bias=((50, 8.0), (banned, -100.0))), 0)
    got = r.choices[0].logprobs.content
    assert [e.logprob for e in got] == pytest.approx([x.logprob for x in ref], abs=1e-4)
    assert runtime.tokenizer.decode([x.token for x in ref]) == r.choices[0].message.content
    assert banned not in [x.token for x in ref]


def test_logit_bias_reaches_the_draft(runtime) -> None:
    """A bias that makes token 50 certain for both models: every drafted node is accepted (an unbiased draft
    would propose its own tokens, and a step would emit about one)."""
    ids = runtime.encode("Hello", chat=True)
    out = [t for step in runtime.generate_ids(ids, TOKENS, SamplingParams(logit_bias=((50, 100.0),))) for t in step]
    assert out == [50] * TOKENS
    assert runtime.stats()["tokens_per_step"] >= 4


def test_apply_logit_bias_adds_per_token() -> None:
    import torch
    x = torch.zeros(2, 5)
    out = apply_logit_bias(x, ((1, 2.0), (4, -3.0), (9, 1.0)))      # id 9 is past the vocabulary: ignored
    assert out.tolist() == [[0, 2, 0, 0, -3]] * 2 and x.abs().sum() == 0


def test_minus_infinity_is_sent_as_a_floor() -> None:
    class Tok:
        def decode(self, ids, **kw):
            return "a"

        def convert_ids_to_tokens(self, i):
            return "a"
    e = lp.entries(Tok(), [TokenLogprob(1, float("-inf"), ((1, float("-inf")),))])[0]
    assert e["logprob"] == lp.FLOOR and e["top_logprobs"][0]["logprob"] == lp.FLOOR and e["bytes"] == [97]
