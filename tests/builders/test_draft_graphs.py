"""CUDA graphs of the draft forward (builders/draft_graphs.py). On the CPU: the span forward a graph captures
(fixed key span, mask built on the device from L0) equals the dense forward; graphs stay off; the runner's
bookkeeping (first use eager, capture on the second, replays, outgrown spans, a reallocated cache) with the
CUDA part faked; the capture is thread-local and never synchronizes the device or empties the allocator (a
loader thread's CUDA calls during it stay legal); the embedding runs outside the captured body; a dropped
draft cache is garbage-collected with its runner; spans grow with the context. On a GPU: replays are bitwise
equal to the eager span forward at every padded batch size, interleaved, across a span boundary and after the
cache grows; and greedy decoding with graphs on equals target-only decoding.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specexec.builders import draft_graphs
from specexec.builders.base import DraftState
from specexec.builders.growth import padded
from specexec.config import EngineConfig
from specexec.decoding.engine import Engine
from specexec.kv.cache import KVCache
from specexec.checkpoints.loading import load_model
from specexec.builders.registry import make_builder
from tests.tiny_models import prompt


def _state(model, device: str, prefix: int = 37, capacity: int = 1200) -> DraftState:
    a = model.args
    cache = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, capacity, torch.float32, device)
    ids = torch.tensor(prompt(3, prefix), device=device)
    pos = torch.arange(prefix, device=device)
    mask = torch.ones(prefix, prefix, dtype=torch.bool, device=device).tril()[None, None]
    model(ids[None], pos[None], mask, cache)
    cache.advance(prefix)
    return DraftState(model, cache, cuda_graphs=False)


def _pass_inputs(state: DraftState, b: int, K: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A plausible tree pass: b rows, each seeing a random subset of the first rows' slots and itself."""
    g = torch.Generator().manual_seed(seed)
    dev = state.cache.k.device
    tokens = torch.randint(7, 300, (b,), generator=g)
    tree_mask = torch.rand(b, K, generator=g) < 0.3
    tree_mask[:, b:] = False
    tree_mask[torch.arange(b), torch.arange(b)] = True
    depths = tree_mask.sum(1)
    L0 = state.cache.length
    return (tokens.to(dev), (L0 + depths).to(dev), tree_mask.to(dev), (L0 + torch.arange(b)).to(dev))


@torch.inference_mode()
def test_span_forward_equals_the_eager_forward_on_cpu(tiny_pair: tuple[Path, Path]) -> None:
    """The graph-capturable span forward (one dense mask over the padded span) gives the eager forward's logits
    (prefix and tree attended apart, merged by log-sum-exp) up to rounding, and the same argmax."""
    model = load_model(tiny_pair[1])
    state = _state(model, "cpu")
    for b, K in ((1, 9), (6, 40), (12, 513)):
        tokens, positions, tree_mask, slots = _pass_inputs(state, b, K, seed=b)
        eager = state.forward(tokens, positions, tree_mask, slots)
        S = draft_graphs.key_span(state.cache.length, K, state.cache.capacity)
        assert S >= state.cache.length + K and (S % draft_graphs.SPAN == 0 or S == state.cache.capacity)
        L0 = torch.full((1,), state.cache.length, dtype=torch.long)
        span = draft_graphs.span_forward(model, state.cache, tokens, positions, tree_mask, slots, L0, S)
        # one softmax over the span vs the split one
        assert (span - eager).abs().max() <= 1e-4 * eager.abs().max(), (span - eager).abs().max()
        assert torch.equal(span.argmax(-1), eager.argmax(-1))


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: replay() reruns the captured body into the static output."""

    def __init__(self, body, out: torch.Tensor) -> None:
        self.body, self.out, self.replays = body, out, 0

    def replay(self) -> None:
        self.out.copy_(self.body())
        self.replays += 1


class CpuGraphs(draft_graphs.DraftGraphs):
    """The runner's bookkeeping (first use eager, capture on the second, replays from static buffers, spans,
    a reallocated cache) with the CUDA part faked."""

    def _record(self, body, device):
        out = body()
        static = body().clone()
        return out, FakeGraph(body, static), static


@torch.inference_mode()
def test_runner_bookkeeping_on_cpu(tiny_pair: tuple[Path, Path]) -> None:
    model = load_model(tiny_pair[1])
    state = _state(model, "cpu", capacity=5000)
    runner = CpuGraphs(model, state.cache)
    first = draft_graphs.key_span(state.cache.length, 100, 5000)

    def check(b: int, K: int, seed: int) -> None:
        tokens, positions, tree_mask, slots = _pass_inputs(state, b, K, seed)
        L0 = torch.full((1,), state.cache.length, dtype=torch.long)
        S = draft_graphs.key_span(state.cache.length, K, state.cache.capacity)
        got = runner.run(tokens, positions, tree_mask, slots)
        want = draft_graphs.span_forward(model, state.cache, tokens, positions, tree_mask, slots, L0, S)
        assert torch.equal(got, want)

    check(4, 100, 0)
    assert not runner.graphs                              # first use: eager
    check(4, 100, 1)
    assert list(runner.graphs) == [(4, 100, first)] and first == draft_graphs.SPAN    # second use: captured
    for seed in range(2, 5):                              # new inputs through the static buffers
        check(4, 100, seed)
    assert runner.graphs[(4, 100, first)].graph.replays == 3
    state.cache.advance(draft_graphs.SPAN)                # L0 + K crosses a span: a new shape, then captured
    check(4, 100, 5)
    check(4, 100, 6)
    assert list(runner.graphs) == [(4, 100, 2 * first)]   # the outgrown span's graph is dropped
    state.cache.grow(6000)                                # reallocated: every graph points at freed memory
    check(4, 100, 7)
    assert not runner.graphs


@torch.inference_mode()
def test_the_captured_body_never_syncs_or_uploads(tiny_pair: tuple[Path, Path]) -> None:
    """What a graph captures (span_hidden: the draft's layers over a fixed key span, the mask built on the
    device from L0) makes no host synchronisation, no data-dependent shape and no upload of host data: each is
    illegal inside a CUDA capture (counted on the CPU by tests/sync_count.py)."""
    from tests.sync_count import SyncCounter

    model = load_model(tiny_pair[1])
    state = _state(model, "cpu", capacity=5000)
    for b, K in ((1, 9), (12, 257)):
        tokens, positions, tree_mask, slots = _pass_inputs(state, b, K, seed=b)
        L0 = torch.full((1,), state.cache.length, dtype=torch.long)
        x = model.embed(tokens[None])
        S = draft_graphs.key_span(state.cache.length, K, state.cache.capacity)
        with SyncCounter() as c:
            draft_graphs.span_hidden(model, state.cache, x, positions, tree_mask, slots, L0, S)
        assert c.total == 0 and c.uploads == 0, (dict(c.ops), c.uploads)


def test_spans_grow_with_the_context_so_a_long_chat_recaptures_rarely() -> None:
    """Every span covers the pass (S >= L0 + K, a multiple of SPAN), hides fewer keys than max(SPAN, a quarter
    of the visible ones), and a chat growing to 64k tokens crosses few spans (each crossing recaptures)."""
    spans = set()
    for n in range(1, 65537, 97):
        S = draft_graphs.key_span(n - 1, 1, 1 << 20)
        assert S >= n and S % draft_graphs.SPAN == 0 and S - n < max(draft_graphs.SPAN, n / 4), (n, S)
        spans.add(S)
    assert len(spans) <= 20, sorted(spans)                # 512-token spans were 128 captures per shape
    assert draft_graphs.key_span(5000, 300, 4096) == 4096  # never past the capacity


class _CapturingGraph:
    """torch.cuda.CUDAGraph's capture calls on the CPU. While a capture is open, a 'loader thread' makes the
    kind of call the pager's reader makes (an event wait): illegal in CUDA when ANOTHER thread captures in the
    global mode, legal under a thread-local capture."""

    modes: list[str] = []
    loader_errors: list[str] = []

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        import threading

        _CapturingGraph.modes.append(capture_error_mode)

        def loader() -> None:
            if capture_error_mode == "global":
                _CapturingGraph.loader_errors.append("cudaEventSynchronize during a global capture")
        t = threading.Thread(target=loader)
        t.start()
        t.join()

    def capture_end(self) -> None:
        pass

    def replay(self) -> None:
        pass


@torch.inference_mode()
def test_capture_is_thread_local_and_never_synchronizes_the_device(tiny_pair: tuple[Path, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.graph synchronizes the device, may collect garbage and empties the allocator's cache on entry,
    and captures in the global mode (the pager's reader thread, waiting on an event meanwhile, then breaks the
    capture and the next streamed pass). The runner captures on a side stream, thread-locally, touching none."""
    import contextlib
    import gc
    from types import SimpleNamespace

    def forbidden(name: str):
        def call(*_a, **_k):
            raise AssertionError(f"{name} during a draft capture")
        return call
    stream = SimpleNamespace(wait_stream=lambda other: None)
    made: list[object] = []

    def new_stream(*_a, **_k):
        made.append(SimpleNamespace(wait_stream=lambda other: None))
        return made[-1]
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, forbidden(f"torch.cuda.{name}"))
    monkeypatch.setattr(gc, "collect", forbidden("gc.collect"))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _CapturingGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    monkeypatch.setattr(_CapturingGraph, "modes", [])
    monkeypatch.setattr(_CapturingGraph, "loader_errors", [])
    model = load_model(tiny_pair[1])
    state = _state(model, "cpu")
    runner = draft_graphs.DraftGraphs(model, state.cache)
    for seed in range(3):
        tokens, positions, tree_mask, slots = _pass_inputs(state, 4, 40, seed)
        runner.run(tokens, positions, tree_mask, slots)
        if seed == 1:
            assert len(runner.graphs) == 1 and not runner.failed       # the second use captured
            break
    assert _CapturingGraph.modes == ["thread_local"] and _CapturingGraph.loader_errors == []
    for b in (1, 2, 8, 16) * 2:                                         # four more shapes, each captured once
        runner.run(*_pass_inputs(state, b, 40, b))
    assert len(runner.graphs) == 5 and len(_CapturingGraph.modes) == 5
    assert made == [runner.side]           # ONE side stream for every capture: each stream has its own workspace


class _EmbedWatch(CpuGraphs):
    """Marks the captured body's runs so a test can see what runs inside a graph."""

    inside = False

    def _record(self, body, device):
        def watched():
            _EmbedWatch.inside = True
            try:
                return body()
            finally:
                _EmbedWatch.inside = False
        return super()._record(watched, device)


@torch.inference_mode()
def test_the_embedding_runs_outside_the_captured_graph(tiny_pair: tuple[Path, Path]) -> None:
    """A self-draft's embedding may be a HostEmbedding (ids copied to the host, rows gathered there): no graph
    can hold it. The runner embeds eagerly before each replay; the graph starts at the first layer."""
    model = load_model(tiny_pair[1])
    state = _state(model, "cpu")
    runner = _EmbedWatch(model, state.cache)
    calls = {"inside": 0, "outside": 0}

    def count(*_args) -> None:
        calls["inside" if _EmbedWatch.inside else "outside"] += 1
    model.embed_tokens.register_forward_pre_hook(count)
    for seed in range(4):
        tokens, positions, tree_mask, slots = _pass_inputs(state, 4, 40, seed)
        runner.run(tokens, positions, tree_mask, slots)
    assert runner.graphs and calls == {"inside": 0, "outside": 4}, calls


def test_a_dropped_draft_cache_is_collected_with_its_graphs(tiny_pair: tuple[Path, Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The runners' table is weakly keyed by the draft cache; a runner holding its cache strongly kept every
    cache (and its graphs' memory) alive forever: one per /budget change, bench row or calibration run."""
    import gc
    import weakref

    monkeypatch.setattr(draft_graphs, "enabled", lambda flag, device: True)
    model = load_model(tiny_pair[1])
    state = _state(model, "cpu")
    r = draft_graphs.runner(model, state.cache, True)
    assert r is not None and draft_graphs.runner(model, state.cache, True) is r        # kept while the cache lives
    alive = weakref.ref(state.cache)
    runner_alive = weakref.ref(r)
    del state, r
    gc.collect()
    assert alive() is None and runner_alive() is None


def test_graphs_are_off_on_cpu_and_behind_a_switch(monkeypatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not draft_graphs.enabled(None, cpu) and not draft_graphs.enabled(True, cpu)
    assert draft_graphs.enabled(None, cuda) and not draft_graphs.enabled(False, cuda)
    monkeypatch.setenv(draft_graphs.ENV, "0")
    assert not draft_graphs.enabled(None, cuda) and draft_graphs.enabled(True, cuda)


@pytest.mark.gpu
@torch.inference_mode()
def test_graph_replays_equal_the_eager_pass_at_every_padded_size(tiny_pair: tuple[Path, Path]) -> None:
    model = load_model(tiny_pair[1], "cuda", "float32")
    state = _state(model, "cuda", capacity=5000)
    runner = draft_graphs.DraftGraphs(model, state.cache)
    K = 257
    sizes = sorted({padded(b) for b in range(1, 129)})
    for round_ in range(3):                            # first use eager, second captures, third replays
        for b in sizes + sizes[::-1]:
            tokens, positions, tree_mask, slots = _pass_inputs(state, b, K, seed=100 * round_ + b)
            L0 = torch.full((1,), state.cache.length, dtype=torch.long, device="cuda")
            S = draft_graphs.key_span(state.cache.length, K, state.cache.capacity)
            want = draft_graphs.span_forward(model, state.cache, tokens, positions, tree_mask, slots, L0, S)
            dense = state.forward(tokens, positions, tree_mask, slots)
            got = runner.run(tokens, positions, tree_mask, slots)
            assert torch.equal(got, want), (round_, b)
            assert torch.allclose(got, dense, atol=1e-4, rtol=1e-4) and torch.equal(got.argmax(-1), dense.argmax(-1))
    assert len(runner.graphs) == len(sizes) and not runner.failed
    state.cache.advance(draft_graphs.SPAN)             # across a span boundary: new captures, still exact
    state.cache.grow(2 * state.cache.capacity)         # a reallocated cache: the old graphs are dropped
    for _ in range(3):
        tokens, positions, tree_mask, slots = _pass_inputs(state, 8, K, seed=7)
        L0 = torch.full((1,), state.cache.length, dtype=torch.long, device="cuda")
        S = draft_graphs.key_span(state.cache.length, K, state.cache.capacity)
        want = draft_graphs.span_forward(model, state.cache, tokens, positions, tree_mask, slots, L0, S)
        assert torch.equal(runner.run(tokens, positions, tree_mask, slots), want)
    assert len(runner.graphs) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["specexec", "dynamic", "static"])
def test_greedy_with_graphs_equals_target_only_on_gpu(tiny_pair: tuple[Path, Path], tiny_perturbed_draft: Path,
                                                      name: str) -> None:
    target = load_model(tiny_pair[0], "cuda", "float32")
    draft = load_model(tiny_perturbed_draft, "cuda", "float32")
    ids = prompt(5)
    base = Engine(target, None, EngineConfig(budget=1, device="cuda"), None)
    want = [t for s in base.generate(ids, 48) for t in s]
    engine = Engine(target, draft, EngineConfig(budget=64, builder=name, device="cuda"), make_builder(name))
    got = [t for s in engine.generate(ids, 48) for t in s]
    again = [t for s in engine.generate(ids, 48) for t in s]         # second call: replays captured graphs
    assert got == want and again == want
    runner = draft_graphs.runner(draft, engine._caches[1], None)
    assert runner is not None and runner.graphs and not runner.failed


@pytest.mark.gpu
def test_graphs_stay_on_while_the_pagers_reader_waits_on_events(tiny_pair: tuple[Path, Path],
                                                                tiny_perturbed_draft: Path, tmp_path: Path) -> None:
    """An SSD-tier target with a slow reader reads ahead while the draft grows its tree, so its reader thread
    records and waits on events while draft graphs are captured (and, to be sure, a thread does so during every
    capture: tests/graph_watch.py). A global-mode capture made those calls illegal: the capture was refused,
    graphs went off and the next streamed pass failed. Thread-local: graphs stay on, output stays exact."""
    import time

    from specexec.config import OffloadConfig
    from specexec.runtime.assembly import Runtime
    from tests.graph_watch import ReaderDuringCapture

    config = EngineConfig(device="cuda", dtype="float32", budget=32, max_new_tokens=32)
    rt = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config, offload=OffloadConfig(
        offload="ssd", quant="none", cache_dir=str(tmp_path)))
    try:
        pager = rt.engine.target.pager
        read = pager.ssd.read_layer
        pager.ssd.read_layer = lambda i, out: (time.sleep(0.02), read(i, out))[1]
        ids = prompt(6)
        with ReaderDuringCapture(pager.copy_stream) as watch:
            got = [t for s in rt.generate_ids(ids, 32) for t in s]
            again = [t for s in rt.generate_ids(ids, 32) for t in s]
        want = [t for s in rt.variant(config, use_draft=False).generate_ids(ids, 32) for t in s]
        runner = draft_graphs.runner(rt.engine.draft, rt.engine._caches[1], None)
        assert got == want == again
        assert watch.captures > 0 and watch.replays > 0 and watch.errors == []
        assert runner is not None and not runner.failed and pager.collect(wait=True).bytes["ssd"] > 0
    finally:
        rt.engine.close()


@pytest.mark.gpu
@torch.inference_mode()
def test_captures_share_one_side_stream_and_stay_within_the_ledger_line(tiny_pair: tuple[Path, Path]) -> None:
    """Every padded batch size captured: one side stream, and the memory the captures reserved (the side
    stream's cuBLAS workspace, the graph pool) within the ledger's "draft graphs" line for this draft, plus
    the allocator's rounding to 20 MiB segments (one for the pool's large blocks, one for its small ones)."""
    from specexec.planning.needs import CUBLAS_WORKSPACE
    from specexec.planning.sizes import forward_bytes

    model = load_model(tiny_pair[1], "cuda", "float32")
    state = _state(model, "cuda", capacity=5000)
    runner = draft_graphs.DraftGraphs(model, state.cache)
    K, sizes = 257, sorted({padded(b) for b in range(1, 129)})
    for b in sizes:                                            # first uses: eager, the eager allocator warms up
        runner.run(*_pass_inputs(state, b, K, seed=b))
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    for b in sizes:                                            # second uses: every size captured
        runner.run(*_pass_inputs(state, b, K, seed=b))
    torch.cuda.synchronize()
    grown = torch.cuda.memory_reserved() - before
    assert len(runner.graphs) == len(sizes) and not runner.failed and runner.side is not None
    line = CUBLAS_WORKSPACE + forward_bytes(model.args, max(sizes), state.cache.capacity, 4, "none", "cuda", 0)
    assert grown <= line + 2 * 20 * 2**20, (grown, line)
