"""Stop strings (specexec/runtime/detokenizer.py StopWatcher, Runtime.generate_text): the text ends just before the
first occurrence of any stop string wherever token boundaries fall, so the text in front of a stop string inside
the same token stays. A property over random outputs (sampled from the tiny pair, seeded) and random stop lists:
stops that begin mid-token, span tokens, come from the prompt (it is not the output: it never cuts), or never
occur; streamed pieces, the ids and the held-back text agree with it."""
from __future__ import annotations

import pytest

from specexec.config import EngineConfig, SamplingParams
from specexec.runtime.assembly import Runtime
from specexec.runtime.detokenizer import Detokenizer, StopWatcher

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PROMPT = "The quick brown fox"
N_NEW = 24
CASES = 80


@pytest.fixture(scope="module")
def runtime(tiny_pair, tiny_perturbed_draft) -> Runtime:
    return Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), EngineConfig(budget=8, dtype="float32"))


def sampling(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed)


def run(rt: Runtime, seed: int, stop: list[str]) -> tuple[list[int], str, list[str]]:
    """(ids, text, the text pieces as streamed) of one generation."""
    ids, pieces = [], []
    for new, piece in rt.generate_text(rt.encode(PROMPT), N_NEW, sampling(seed), stop):
        assert new or piece, "an empty piece was streamed"
        ids += new
        pieces.append(piece)
    return ids, "".join(pieces), pieces


def cut_before_first(text: str, stops: list[str]) -> str:
    hits = [text.find(s) for s in stops if s and s in text]
    return text[:min(hits)] if hits else text


@st.composite
def stop_lists(draw, full: str, prompt: str) -> list[str]:
    """1-4 stop strings: pieces of the output (any start, any length: mid-token, across tokens), pieces of the
    prompt, and strings that may never occur."""
    out = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["output", "output", "prompt", "other"]))
        source = full if kind == "output" and full else prompt
        if kind == "other":
            out.append(draw(st.text(alphabet="ab #\n)(xyz.", min_size=1, max_size=4)))
            continue
        start = draw(st.integers(0, len(source) - 1))
        out.append(source[start:start + draw(st.integers(1, 6))])
    return out


def test_a_stop_inside_a_token_keeps_the_text_before_it(runtime: Runtime) -> None:
    """The first output token that holds at least two characters: a stop string starting at its second character
    keeps the first one (the old rule dropped the whole token)."""
    for seed in range(20):
        ids, full, _ = run(runtime, seed, [])
        detok = Detokenizer(runtime.tokenizer, runtime.encode(PROMPT))
        for k in range(len(ids)):
            before, upto = detok.text(ids[:k]), detok.text(ids[:k + 1])
            if len(upto) - len(before) >= 2 and full.find(upto[len(before) + 1:]) == len(before) + 1:
                stop = upto[len(before) + 1:]
                got_ids, text, _ = run(runtime, seed, [stop])
                assert text == full[:len(before) + 1]
                assert got_ids == ids[:k + 1]                        # the token it begins in is kept
                return
    pytest.skip("no output token of two characters or more")


@pytest.fixture(scope="module")
def outputs(runtime: Runtime) -> dict[int, tuple[list[int], str]]:
    """Unstopped generations by seed, made once."""
    return {}


def unstopped(rt: Runtime, outputs: dict, seed: int) -> tuple[list[int], str]:
    if seed not in outputs:
        outputs[seed] = run(rt, seed, [])[:2]
    return outputs[seed]


@pytest.mark.slow
@settings(max_examples=CASES, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 30), data=st.data())
def test_stopped_text_is_the_unstopped_text_cut_before_the_first_stop(runtime: Runtime, outputs, seed: int,
                                                                      data) -> None:
    full_ids, full = unstopped(runtime, outputs, seed)
    stops = data.draw(stop_lists(full, PROMPT))
    ids, text, pieces = run(runtime, seed, stops)
    assert text == cut_before_first(full, stops), (stops, full)
    assert ids == full_ids[:len(ids)]                                # the same generation, cut
    detok = Detokenizer(runtime.tokenizer, runtime.encode(PROMPT))
    assert detok.text(ids).startswith(text) and not any(s in text for s in stops)
    if any(s in full for s in stops) and ids:           # no kept token lies wholly past the cut (but textless ones)
        assert detok.text(ids) == detok.text(ids[:-1]) or len(detok.stable_text(ids[:-1])) < len(text)


def test_what_a_stream_may_show_never_begins_a_stop_string(runtime: Runtime) -> None:
    """StopWatcher.shown holds back exactly the longest end of the text that begins some stop string; once one
    is seen it keeps the tokens holding the text before it, and shows up to it. A stop string found does not end
    the generation while another may still begin before it."""
    w = StopWatcher(Detokenizer(runtime.tokenizer, []), ["\n#", "abc", "x"])
    assert w.shown("foo") == 3 and w.shown("foo\n") == 3 and w.shown("fooab") == 3 and w.shown("fooa") == 3
    assert w.shown("foo\n#") == 3 and w.shown("foo\n#ab") == 3
    ids = runtime.tokenizer.encode("ret)\n# x", add_special_tokens=False)
    keep = w(ids)
    assert w.cut == 4 and w.shown("ret)\n# x") == 4
    assert w.detok.text(ids[:keep]).startswith("ret)") and len(w.detok.stable_text(ids[:keep - 1])) < 4
    late = StopWatcher(Detokenizer(runtime.tokenizer, []), [" ", "T ab"])
    assert late(runtime.tokenizer.encode("T a", add_special_tokens=False)) is None     # "T ab" may begin at 0
    assert late(runtime.tokenizer.encode("T ac", add_special_tokens=False)) is not None and late.cut == 1
