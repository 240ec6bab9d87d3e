"""A test-sized soak: many chat conversations through one loaded runtime (target streamed from the SSD tier, so
the pager thread, its slots and the cache's descriptors are exercised on every pass), each with its own
builder, budget and sampling settings, hundreds of decoding steps in all. After a warm-up, the process's
resident memory, open descriptors and threads must not grow; every greedy conversation, whatever its builder
and budget, answers exactly what the first one did (same messages, fp32: the exactness contract).
"""
from __future__ import annotations

import gc
import random
import threading
import time

import pytest

from cli.chat import ChatSession
from specexec.config import SamplingParams
from specexec.runtime.assembly import Runtime
from tests.cli.screen import Screen
from tests.faults.faults_helpers import open_fds, pager_threads, rss_bytes, streamed_runtime

BUILDERS = ("specexec", "chain", "dynamic", "rsd", "recycling")
TEMPERATURES = (0.0, 0.6, 1.0)
TURNS = ("Hello there", "Tell me a story about a tree", "What is the capital of France?")
MAX_NEW = 20
WARMUP, CONVERSATIONS = 3, 6
RSS_SLACK = 30 << 20


@pytest.fixture(scope="module")
def runtime(tiny_pair, tiny_perturbed_draft, tmp_path_factory) -> Runtime:
    yield from streamed_runtime(tiny_pair, tiny_perturbed_draft, tmp_path_factory.mktemp("soak-cache"), budget=8)


def conversation(runtime: Runtime, k: int, rng: random.Random, greedy: dict) -> int:
    """One conversation with random settings; returns its decoding steps. Greedy ones are checked against the
    first greedy conversation's answers."""
    builder = BUILDERS[k % len(BUILDERS)]                   # every builder, in turn
    temperature = 0.0 if k % 3 == 0 else rng.choice(TEMPERATURES)
    sampling = SamplingParams(temperature=temperature, top_p=rng.choice((1.0, 0.9, 0.8)), seed=rng.randrange(1000))
    budget = rng.choice((2, 4, 8, 16))
    variant = runtime.variant(runtime.config.replace(builder=builder, budget=budget))
    screen = Screen()
    chat = ChatSession(variant, sampling, None, screen.console, screen.write, MAX_NEW)
    steps = 0
    for turn in TURNS:
        answer = chat.ask(turn)
        assert not answer.interrupted and answer.ids
        steps += len(variant.engine.stats.steps)
    if temperature == 0.0:
        answers = [m["content"] for m in chat.messages[1::2]]
        assert greedy.setdefault("answers", answers) == answers, (builder, budget)
    return steps


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_soak_many_conversations_no_growth(runtime) -> None:
    rng, greedy = random.Random(0), {}
    t0 = time.monotonic()
    steps = sum(conversation(runtime, k, rng, greedy) for k in range(WARMUP))
    gc.collect()
    rss, fds, threads = rss_bytes(), open_fds(), threading.active_count()
    pagers = pager_threads()
    for k in range(WARMUP, WARMUP + CONVERSATIONS):
        steps += conversation(runtime, k, rng, greedy)
    gc.collect()
    grew = rss_bytes() - rss
    assert steps >= 200, steps                                  # hundreds of decoding steps in all
    assert grew < RSS_SLACK, f"resident memory grew {grew / 2**20:.1f} MB over {CONVERSATIONS} conversations"
    assert open_fds() - fds <= 2, (fds, open_fds())
    assert threading.active_count() <= threads and pagers and pager_threads() <= pagers      # no new threads
    assert "answers" in greedy
    print(f"soak: {steps} steps in {time.monotonic() - t0:.1f} s, RSS {grew / 2**20:+.1f} MB")
