"""Prefill and KV caches sized by the plan, on tiny models (fp32, CPU):
- a streamed target prefills a 2,000-token prompt in ONE pass when its plan allows (the pager's pass counter),
  where a 512-token chunk (the old fixed default, still an explicit cap) takes four; the outputs agree;
- the target's and the draft's KV caches are each sized for their own user, allocated at the planned context,
  and grow to what is needed (never doubling) past it;
- the embedding table kept in host RAM gives the same numbers as the resident table;
- a 16k-token prompt takes as few streamed passes as the plan's activation budget allows (not 32), and the
  progress bar for long prefills shows only when a prefill takes more than one pass or a second.
"""
from __future__ import annotations

import io
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from cli.prefill_bar import PrefillBar, worth_showing

from specexec.builders.specexec import SpecExecBuilder
from specexec.config import PREFILL_CHUNK, EngineConfig, OffloadConfig
from specexec.decoding.engine import KV_GROW_QUANTUM, Engine
from specexec.generation import PrefillProgress
from specexec.checkpoints.loading import load_model, read_args
from specexec.network.model import prefix_tree_mask
from specexec.checkpoints.naming import layer_names
from specexec.runtime.offloaded import HostEmbedding, build_offloaded
from specexec.runtime.assembly import Runtime
from tests.tiny_models import write_tiny_model

PROMPT_TOKENS = 2000


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer tiny Llama whose context holds a 2,000-token prompt."""
    return write_tiny_model(tmp_path_factory.mktemp("long") / "llama", "llama", seed=21, n_layers=4,
                            max_position_embeddings=4096)


def prefill_passes(rt: Runtime, ids: list[int]) -> tuple[int, list[int]]:
    """(streamed passes spent on the prefill, the generated ids) of one generate call of one new token."""
    out = [t for step in rt.generate_ids(ids, 1) for t in step]
    stats = rt.stats()
    return stats["passes"] - stats["steps"], out


def test_a_streamed_2000_token_prompt_is_one_pass(long_model: Path, tmp_path: Path) -> None:
    ids = torch.randint(7, 300, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    offload = OffloadConfig(offload="ssd", quant="none", cache_dir=str(tmp_path))
    planned = Runtime.load(str(long_model), None, EngineConfig(budget=4), offload=offload)
    capped = Runtime.load(str(long_model), None, EngineConfig(budget=4, prefill_chunk=PREFILL_CHUNK), offload=offload)
    try:
        assert planned.engine.target.prefill_tokens == planned.plan.memory.prefill_tokens >= PROMPT_TOKENS
        n_planned, out_planned = prefill_passes(planned, ids)
        n_capped, out_capped = prefill_passes(capped, ids)
        assert n_planned == 1
        assert n_capped == math.ceil((PROMPT_TOKENS - 1) / PREFILL_CHUNK) == 4
        assert out_planned == out_capped
    finally:
        planned.engine.close()
        capped.engine.close()


def test_a_resident_model_keeps_the_modest_chunk(tiny_pair) -> None:
    model = load_model(tiny_pair[0])
    engine = Engine(model, None, EngineConfig(), None)
    assert engine.prefill_chunk(model) == PREFILL_CHUNK
    assert Engine(model, None, EngineConfig(prefill_chunk=64), None).prefill_chunk(model) == 64
    streamed = SimpleNamespace(prefill_tokens=3000)    # what a streamed target is built with (PlansPrefill)
    assert engine.prefill_chunk(streamed) == 3000
    assert Engine(model, None, EngineConfig(prefill_chunk=64), None).prefill_chunk(model) == 64


def test_each_kv_cache_is_sized_for_its_own_user(tiny_pair, tiny_perturbed_draft) -> None:
    target, draft = load_model(tiny_pair[0]), load_model(tiny_perturbed_draft)
    ids = list(range(10, 30))
    budget, new = 8, 5
    scratch = SpecExecBuilder().kv_slots(budget)                        # 2 * budget + 1 draft slots per tree
    engine = Engine(target, draft, EngineConfig(budget=budget), SpecExecBuilder())
    list(engine.generate(ids, new))
    t, d = engine._caches
    assert (t.capacity, d.capacity) == (len(ids) + new + budget + 1, len(ids) + new + scratch + 1)
    planned = Engine(target, draft, EngineConfig(budget=budget), SpecExecBuilder(), context=200)
    first = [x for s in planned.generate(ids, new) for x in s]
    t, d = planned._caches
    assert (t.capacity, d.capacity) == (200 + budget + 1, 200 + scratch + 1)   # allocated at the plan, once
    longer = ids + first + list(range(40, 240))                         # a chat turn past the planned context
    list(planned.generate(longer, new))
    need = len(longer) + new + budget + 1
    assert t.capacity == math.ceil(need / KV_GROW_QUANTUM) * KV_GROW_QUANTUM < 2 * (200 + budget + 1)
    assert planned._caches[0] is t and t.length >= len(longer) - 1


def test_the_embedding_in_host_ram_is_exact(tiny_pair, tmp_path: Path) -> None:
    from offload.cache.store import LayerCache

    path = tiny_pair[0]
    args = read_args(path)
    cache = LayerCache.open_or_build(path, layer_names(path, args), "none", torch.float32, cache_root=tmp_path,
                                     progress=False)
    ref = load_model(path)
    host = build_offloaded(path, args, cache, ["resident", "ssd", "ram", "ssd"], torch.device("cpu"),
                           torch.float32, embed_on_host=True)
    try:
        assert isinstance(host.embed_tokens, HostEmbedding)
        assert not any(p is host.embed_tokens.weight for p in host.parameters())    # not a parameter: stays put
        tokens = torch.randint(7, 300, (1, 13), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(13)[None]
        mask = prefix_tree_mask(0, torch.ones(13, 13).tril().bool())
        assert torch.equal(host(tokens, pos, mask), ref(tokens, pos, mask))
        assert torch.equal(host.embed_tokens(tokens), ref.embed_tokens(tokens))
    finally:
        host.close()
        cache.close()


# ------------------------------------------------------------------------------------------------ long prompts

LONG_PROMPT = 16384


@pytest.fixture(scope="module")
def longer_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer tiny Llama whose context holds a 16k-token prompt."""
    return write_tiny_model(tmp_path_factory.mktemp("longer") / "llama", "llama", seed=22, n_layers=2,
                            max_position_embeddings=32768)


def budget_for_chunk(path: Path, chunk: int) -> tuple[int, int]:
    """A --ram-budget whose plan (streamed target, --context 16k + 64) prefills about `chunk` tokens per pass,
    and that plan's exact figure: the activation budget the plan gives is what sizes the prefill."""
    from offload.memory_plan import PlanError
    from specexec.planning.ledger import plan_memory
    from specexec.planning.run_shape import run_shape

    shape = run_shape(read_args(path), None, EngineConfig(budget=4), OffloadConfig(context=LONG_PROMPT + 64), "cpu",
                      torch.float32)
    lo, hi = 10**6, 10**10
    while hi - lo > 10**5:
        mid = (lo + hi) // 2
        try:
            tokens = plan_memory(shape, ("none",), ram=mid, gpu=None, mode="ssd").prefill_tokens
        except PlanError:
            tokens = 0
        lo, hi = (mid, hi) if tokens < chunk else (lo, mid)
    return hi, plan_memory(shape, ("none",), ram=hi, gpu=None, mode="ssd").prefill_tokens


def test_a_16k_prompt_takes_as_few_streamed_passes_as_the_activation_budget_allows(longer_model: Path,
                                                                                 tmp_path: Path) -> None:
    """The issue's bar: 16k tokens must not cost 32 streamed passes. With a RAM budget whose plan leaves
    activations for ~4k tokens, the prefill takes exactly ceil(16383 / planned) passes (4 or 5), counted by
    the pager, and the progress callback hears every one."""
    budget, planned = budget_for_chunk(longer_model, 4096)
    assert 3000 <= planned < LONG_PROMPT
    offload = OffloadConfig(offload="ssd", quant="none", cache_dir=str(tmp_path), ram_budget=budget,
                            context=LONG_PROMPT + 64)
    rt = Runtime.load(str(longer_model), None, EngineConfig(budget=4), offload=offload)
    heard = []
    rt.engine.on_prefill = lambda p: heard.append((p.which, p.done, p.total, p.passes_done, p.passes))
    ids = torch.randint(7, 300, (LONG_PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()
    try:
        assert rt.engine.target.prefill_tokens == planned
        passes, _ = prefill_passes(rt, ids)
        want = math.ceil((LONG_PROMPT - 1) / planned)
        assert passes == want < 32 and want <= 6
        assert [h[3] for h in heard] == list(range(1, want + 1)) and heard[-1][1:3] == (LONG_PROMPT - 1,) * 2
        assert all(h[0] == "target" and h[4] == want for h in heard)
    finally:
        rt.engine.close()


def test_the_progress_bar_shows_only_for_long_prefills() -> None:
    now = time.perf_counter()
    assert not worth_showing(PrefillProgress("target", 100, 1, now))                 # one quick pass
    assert worth_showing(PrefillProgress("target", 100, 2, now))                      # two passes
    assert worth_showing(PrefillProgress("target", 100, 1, now - 2.0))                # one slow pass
    bar = PrefillBar(Console(file=io.StringIO(), force_terminal=True, width=100))
    bar(PrefillProgress("target", 100, 1, now, done=100, passes_done=1))
    assert bar.progress is None                                                       # nothing drawn
    slow = PrefillProgress("target", 8000, 4, now - 3.0, done=2000, passes_done=1)
    bar(slow)
    assert bar.progress is not None and "target" in bar.progress.tasks[0].description
    assert bar.progress.tasks[0].completed == 2000 and bar.progress.tasks[0].fields["rate"] > 0
    bar.stop()
    bar(slow)
    assert bar.progress is None and bar.stopped
