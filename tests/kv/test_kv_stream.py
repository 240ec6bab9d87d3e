"""KV that streams with its layer (specexec/kv/cache.py, kv_stream.py), on the CPU's RAM tier (fp32, tiny models):
- a cache with streamed layers holds the same rows, bit for bit, as a device cache under any sequence of
  write / keep / advance / truncate / grow (tail path and write-through path);
- what moves is counted: a pass stages exactly the committed rows of each streamed layer (H2D), a step writes
  back exactly the ACCEPTED rows (D2H), a prefill chunk its own rows; the pager counts the staged bytes;
- greedy generation through an offloaded target whose KV streams equals the one whose KV stays on the device
  (and target-only decoding) for several builders, across chat turns that reuse the prefix and a cache that
  grows past its plan;
- the planner streams a streamed layer's KV only when the device runs short (or when asked), counts it in
  the pass time and prints it; Runtime/CLI carry --kv-offload stream end to end.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli.main import main
from offload.cache.store import LayerCache
from offload.streaming.tiers import is_pinned
from specexec.builders.chain import ChainBuilder
from specexec.builders.dynamic import DynamicBuilder
from specexec.builders.specexec import SpecExecBuilder
from specexec.config import EngineConfig, OffloadConfig
from specexec.decoding.engine import Engine
from specexec.kv.cache import KVCache
from specexec.kv.rows import row_bytes
from specexec.checkpoints.loading import load_model, read_args
from specexec.network.model import TreeMask
from specexec.checkpoints.naming import layer_names
from specexec.runtime.offloaded import OffloadedTransformer, build_offloaded
from specexec.runtime.assembly import Runtime

CPU = torch.device("cpu")
LAYERS, HEADS, DIM = 3, 2, 4


def pair(capacity: int = 40, tail: int = 6, streamed=(0, 2)) -> tuple[KVCache, KVCache]:
    """A device cache and one whose layers `streamed` live in host RAM (no pager: they stage themselves)."""
    args = (LAYERS, HEADS, DIM, capacity, torch.float32, CPU)
    return KVCache(*args), KVCache(*args, streamed=streamed, tail=tail)


def rows(gen: torch.Generator, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, HEADS, T, DIM, generator=gen), torch.randn(1, HEADS, T, DIM, generator=gen)


def write_all(caches, slots: torch.Tensor, gen: torch.Generator) -> None:
    for layer in range(LAYERS):
        k, v = rows(gen, slots.numel())
        for c in caches:
            c.begin_forward() if layer == 0 else None
            c.write(layer, slots, k, v)


def same(a: KVCache, b: KVCache, n: int) -> bool:
    return all(torch.equal(x, y) for layer in range(LAYERS) for x, y in zip(a.view(layer, n), b.view(layer, n)))


def test_streamed_rows_equal_device_rows_under_every_operation() -> None:
    gen = torch.Generator().manual_seed(0)
    dev, streamed = pair()
    assert streamed.streamed_layers == [0, 2] and not dev.streams and streamed.streams
    write_all((dev, streamed), torch.arange(0, 9), gen)              # 9 > tail: straight to the host rows
    for c in (dev, streamed):
        c.advance(9)
    assert same(dev, streamed, 9)
    write_all((dev, streamed), torch.arange(9, 14), gen)             # a tree of 5 (<= tail): kept on the device
    for c in (dev, streamed):
        c.keep(torch.tensor([9, 11, 12]))
    assert dev.length == streamed.length == 12 and same(dev, streamed, 12)
    for c in (dev, streamed):
        c.truncate(10)
    write_all((dev, streamed), torch.arange(10, 13), gen)
    for c in (dev, streamed):
        c.advance(3)
        c.grow(64)
    assert streamed.capacity == 64 and same(dev, streamed, 13)
    write_all((dev, streamed), torch.arange(13, 40), gen)            # long chunk after growth, then a keep of it
    for c in (dev, streamed):
        c.keep(torch.tensor([13, 20, 39]))
    assert same(dev, streamed, 16)


def test_a_fuzzed_sequence_of_operations_keeps_them_equal() -> None:
    gen = torch.Generator().manual_seed(1)
    dev, streamed = pair(capacity=200, tail=8, streamed=(1,))
    for _ in range(60):
        random_op((dev, streamed), gen, write_all)
        assert dev.length == streamed.length and same(dev, streamed, dev.length)


def random_op(caches, gen: torch.Generator, write) -> int:
    """One random operation on every cache alike: 0 a prefill chunk (tail or write-through), 1 a tree and a kept
    path, 2 a truncation, 3 a pass never committed (write(caches, slots, gen) writes each layer's rows)."""
    op, L, capacity = int(torch.randint(0, 4, (), generator=gen)), caches[0].length, caches[0].capacity
    if op == 0 and L + 20 < capacity:
        T = int(torch.randint(1, 16, (), generator=gen))
        write(caches, torch.arange(L, L + T), gen)
        for c in caches:
            c.advance(T)
    elif op == 1 and L + 10 < capacity:
        T = int(torch.randint(1, 9, (), generator=gen))
        write(caches, torch.arange(L, L + T), gen)
        keep = sorted(set(torch.randint(L, L + T, (3,), generator=gen).tolist()))
        for c in caches:
            c.keep(torch.tensor(keep))
    elif op == 2 and L:
        n = int(torch.randint(0, L + 1, (), generator=gen))
        for c in caches:
            c.truncate(n)
    elif op == 3:
        write(caches, torch.arange(L, L + 4), gen)
    return op


def same_window(a: KVCache, b: KVCache, n: int, windows) -> bool:
    """The rows each layer's window sees of the first n: [n - W + 1, n) for a sliding layer, all else."""
    def seen(c: KVCache, layer: int):
        lo = max(0, n - windows[layer] + 1) if windows[layer] else 0
        if c.streams and c.stream.discard is not None:      # pager-staged: stage the layer as a pager would
            c.companion(layer, 0, lambda: False)
        return [t[:, :, lo:n] for t in c.view(layer, n)]
    return all(torch.equal(x, y) for layer in range(LAYERS) for x, y in zip(seen(a, layer), seen(b, layer)))


@pytest.mark.parametrize("staged", ["self", "pager"])
def test_a_sliding_layer_streams_only_its_window_and_holds_the_same_rows(staged: str) -> None:
    """Fuzzed prefill chunks, trees, truncations (below what was staged, too) and uncommitted passes: every
    row a sliding layer's window sees equals the device cache's; per pass it moves in at most W - 1 rows,
    a full layer everything committed. With a pager's `companion` staging, the same."""
    gen = torch.Generator().manual_seed(4)
    windows = (5, None, 3)
    args = (LAYERS, HEADS, DIM, 200, torch.float32, CPU)
    dev = KVCache(*args)
    streamed = KVCache(*args, streamed=(0, 1, 2), tail=8, windows=windows)
    if staged == "pager":
        streamed.attach(1, lambda: None)
    row = row_bytes(HEADS, DIM, 4)
    for _ in range(80):
        L, s = dev.length, streamed.stream
        before = s.moved_in
        op = random_op((dev, streamed), gen, lambda caches, slots, g: _write_staged(caches, slots, g, staged))
        if op in (0, 1, 3):
            moved = s.moved_in - before                  # bytes H2D
            assert moved <= (4 + L + 2) * row, (op, L, moved)   # windows 5 and 3: at most 4 + 2 rows, plus L
        assert dev.length == streamed.length and same_window(dev, streamed, dev.length, windows)
    assert streamed.stream.first_needed(0, 100) == 96 and streamed.stream.first_needed(1, 100) == 0


def _write_staged(caches, slots: torch.Tensor, gen: torch.Generator, staged: str) -> None:
    """write_all, with the streamed cache's layer staged by its companion first (as the pager does)."""
    for layer in range(LAYERS):
        k, v = rows(gen, slots.numel())
        for c in caches:
            c.begin_forward() if layer == 0 else None
            if staged == "pager" and c.streams:
                c.companion(layer, 0, lambda: False)
            c.write(layer, slots, k, v)


def test_what_moves_is_counted() -> None:
    """H2D: the committed rows of a layer each time it is staged; D2H: only the accepted rows."""
    gen = torch.Generator().manual_seed(2)
    _, c = pair(capacity=64, tail=8, streamed=(0, 1, 2))
    row = row_bytes(HEADS, DIM, 4)
    write_all((c,), torch.arange(0, 20), gen)           # 20 rows > tail 8: written through (the prefill)
    c.advance(20)
    s = c.stream
    assert (s.moved_in, s.moved_out) == (0, 3 * 20 * row)                  # an empty prefix moves nothing in
    s.moved_in = s.moved_out = 0
    write_all((c,), torch.arange(20, 28), gen)          # a tree of 8: each layer stages the 20 committed rows
    assert s.moved_in == 3 * 20 * row and s.moved_out == 0
    c.keep(torch.tensor([20, 23, 27]))                  # 3 accepted rows per layer go back, nothing else
    assert s.moved_out == 3 * 3 * row and c.length == 23


def test_int8_rows_stream_the_same_quantized_values() -> None:
    gen = torch.Generator().manual_seed(3)
    args = (LAYERS, HEADS, DIM, 32, torch.float32, CPU)
    dev, streamed = KVCache(*args, quant="int8"), KVCache(*args, quant="int8", streamed=(1,), tail=4)
    exact = KVCache(*args)
    write_all((dev, streamed, exact), torch.arange(0, 10), gen)
    for c in (dev, streamed, exact):
        c.advance(10)
    assert same(dev, streamed, 10)                                          # int8 is int8, wherever it lives
    k8, _ = dev.view(0, 10)
    k, _ = exact.view(0, 10)
    assert not torch.equal(k8, k) and torch.allclose(k8, k, atol=k.abs().max().item() / 100)
    assert dev.nbytes == LAYERS * 32 * 2 * HEADS * (DIM + 4) == LAYERS * 32 * row_bytes(HEADS, DIM, 4, "int8")
    assert exact.nbytes == LAYERS * 32 * 2 * HEADS * DIM * 4               # int8: 1 byte + a 4-byte scale per row


def test_a_streamed_layer_outside_the_tail_must_write_in_order() -> None:
    _, c = pair(tail=2)
    with pytest.raises(ValueError, match="only at"):
        c.write(0, torch.tensor([3, 4, 5]), *rows(torch.Generator().manual_seed(0), 3))


# ----------------------------------------------------------------------------------------------- with a pager

@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-layer-cache")


def offloaded(path: Path, tiers: list[str], root: Path, kv_streamed: tuple[int, ...] = ()) -> OffloadedTransformer:
    args = read_args(path)
    cache = LayerCache.open_or_build(path, layer_names(path, args), "none", torch.float32, cache_root=root,
                                     progress=False)
    return build_offloaded(path, args, cache, tiers, CPU, torch.float32, kv_streamed=kv_streamed)


BUILDERS = {"specexec": SpecExecBuilder, "chain": ChainBuilder, "dynamic": DynamicBuilder}


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_greedy_output_with_streamed_kv_equals_device_kv(tiny_pair, tiny_perturbed_draft, cache_root,
                                                         builder: str) -> None:
    """Two chat turns (the second reuses the first's prefix), prefill chunks longer and shorter than the tail,
    and a cache that outgrows its planned context: every token equals the device-KV run and target-only."""
    target, draft = tiny_pair[0], load_model(tiny_perturbed_draft)
    gen = torch.Generator().manual_seed(7)
    turn1 = torch.randint(7, 300, (30,), generator=gen).tolist()
    tiers = ["resident", "ram", "ssd", "ram"]

    def run(kv: tuple[int, ...], with_draft: bool = True) -> tuple[list[list[int]], Engine]:
        model = offloaded(target, tiers, cache_root, kv)
        engine = Engine(model, draft if with_draft else None, EngineConfig(budget=6, prefill_chunk=9),
                        BUILDERS[builder]() if with_draft else None, context=40)
        first = [t for s in engine.generate(turn1, 16) for t in s]
        turn2 = turn1 + first + torch.randint(7, 300, (5,), generator=torch.Generator().manual_seed(8)).tolist()
        second = [t for s in engine.generate(turn2, 16) for t in s]
        model.close()
        return [first, second], engine

    want, _ = run(())
    got, engine = run((1, 2, 3))
    assert got == want
    assert run((), with_draft=False)[0] == want
    cache = engine._caches[0]
    assert cache.streamed_layers == [1, 2, 3] and cache.capacity > 40 + 7     # grew past the plan
    assert engine.target.pager.stats.companion_bytes > 0
    assert engine.stats.reused_tokens > 0                                     # turn 2 kept turn 1's rows


def test_the_pager_stages_exactly_the_committed_rows(tiny_pair, cache_root) -> None:
    """Per pass, each streamed layer's stage holds exactly the committed rows: what the pager staged with the
    layer (H2D) plus what was topped up since (the accepted rows of a read-ahead made before the commit), never
    the whole cache; and every committed row went back (D2H) exactly once."""
    model = offloaded(tiny_pair[0], ["ram"] * 4, cache_root, (0, 1, 2, 3))
    a = model.args
    row = row_bytes(a.n_kv_heads, a.head_dim, 4)
    engine = Engine(model, None, EngineConfig(budget=4), None, context=64)
    ids = list(range(10, 30))
    try:
        list(engine.generate(ids, 3))       # prefill 19 rows (nothing committed yet), passes over 19, 20, 21 rows
        s, kv = model.pager.stats, engine._caches[0].stream
        assert s.passes == 4 and engine._caches[0].length == 22
        assert s.companion_bytes + kv.topped_up == (19 + 20 + 21) * 4 * row    # staged with the layer + topped up
        assert s.companion_bytes <= kv.moved_in
        assert kv.moved_out == 22 * 4 * row                                # each committed row written back once
        assert kv.host.capacity == engine._caches[0].capacity
    finally:
        model.close()


@pytest.mark.parametrize("n_slots", [1, 2])
def test_a_held_layers_stage_keeps_its_rows_while_the_others_are_staged(tiny_pair, cache_root, n_slots: int) -> None:
    """The rows a layer's attention reads live in the stage of its slot: with the pager's loaders as far ahead as
    they get (the other slots and their stages refilled with later layers: wait_idle), the held layer's stage
    still holds its own committed rows, the host's, until the pass moves on."""
    args = read_args(tiny_pair[0])
    cache = LayerCache.open_or_build(tiny_pair[0], layer_names(tiny_pair[0], args), "none", torch.float32,
                                     cache_root=cache_root, progress=False)
    model = build_offloaded(tiny_pair[0], args, cache, ["ram"] * 4, CPU, torch.float32, n_slots=n_slots,
                            kv_streamed=(0, 1, 2, 3))
    engine = Engine(model, None, EngineConfig(budget=4), None, context=64)
    try:
        list(engine.generate(list(range(10, 30)), 3))
        kv = engine._caches[0].stream
        L = engine._caches[0].length
        model.pager.prefetch_start()
        with torch.inference_mode():                  # (as a forward does: the top-up writes inference tensors)
            held_layers_check(model, kv, L)
    finally:
        model.close()


def held_layers_check(model: OffloadedTransformer, kv, L: int) -> None:
    """Each layer in turn as a pass holds it: its stage's L rows, read, still the host's once the loaders idle."""
    for i, _ in model.pager.layers(range(4)):
        staged = kv.view(i, L)
        assert model.pager.wait_idle(10)
        want = kv.host.read(kv.index[i], L)
        assert all(torch.equal(x, y) for x, y in zip(staged, want)), f"layer {i}"
        assert all(torch.equal(x, y) for x, y in zip(kv.view(i, L), want)), f"layer {i}"


def test_a_stage_filled_before_a_commit_is_topped_up_from_the_device() -> None:
    """The pager's read-ahead after a pass runs before the pass's rows are committed: the stage lacks the
    accepted rows, and they come from the commit's device copy, not back from the host. (The pager is played
    by hand: two slots, layer i in slot i % 2, layers 0 and 1 read ahead.)"""
    gen = torch.Generator().manual_seed(4)
    dev, c = pair(capacity=40, tail=6, streamed=(0, 1, 2))
    c.attach(2, discard=lambda: None)
    never = lambda: False                                                   # noqa: E731
    row = row_bytes(HEADS, DIM, 4)

    def one_pass(slots: torch.Tensor, read_ahead: bool) -> None:
        for cache in (dev, c):
            cache.begin_forward()
        for layer in range(LAYERS):
            if layer >= 2 or not read_ahead:
                c.companion(layer, layer % 2, never)
            k, v = rows(gen, slots.numel())
            for cache in (dev, c):
                cache.write(layer, slots, k, v)
        for layer in (0, 1):                                                # the next pass's read-ahead
            c.companion(layer, layer, never)

    one_pass(torch.arange(0, 5), read_ahead=False)
    for cache in (dev, c):
        cache.advance(5)                                                    # committed after the read-ahead
    one_pass(torch.arange(5, 10), read_ahead=True)
    # layers 0, 1 topped up with the 5 committed rows; layer 2 and the next read-ahead staged them (H2D)
    assert c.stream.topped_up == 2 * 5 * row and c.stream.moved_in == 3 * 5 * row
    for cache in (dev, c):
        cache.keep(torch.tensor([5, 7]))
    moved_in = c.stream.moved_in
    one_pass(torch.arange(7, 9), read_ahead=True)
    assert c.stream.topped_up == 2 * 5 * row + 2 * 2 * row                  # the 2 accepted rows, on the device
    assert c.stream.moved_in == moved_in + 7 * row + 2 * 7 * row            # layer 2; the next read-ahead
    for layer in range(LAYERS):                                             # the host rows are the device rows
        assert all(torch.equal(x, y) for x, y in zip(dev.view(layer, 7), c.stream.host.read(layer, 7)))


def test_nothing_staged_with_a_pager_attached_is_a_loud_error() -> None:
    _, c = pair()
    c.attach(2, discard=lambda: None)
    with pytest.raises(RuntimeError, match="not staged"):
        c.write(0, torch.arange(0, 3), *rows(torch.Generator().manual_seed(0), 3))


# ----------------------------------------------------------------------------------------------- Runtime / CLI

def test_runtime_with_kv_offload_stream_matches_and_says_so(tiny_pair, tiny_perturbed_draft, cache_root) -> None:
    config = EngineConfig(budget=8, max_new_tokens=12)
    common = {"offload": "ssd", "quant": "none", "cache_dir": str(cache_root)}
    plain = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config, offload=OffloadConfig(**common))
    streamed = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config,
                            offload=OffloadConfig(kv_offload="stream", **common))
    try:
        assert plain.plan.plan.companions_streamed == [] and streamed.plan.plan.companions_streamed == [0, 1, 2, 3]
        assert "target KV cache streamed with 4 layers" in streamed.plan.describe()
        prompt = plain.encode("The quick brown fox jumps over the lazy dog")
        a = [t for s in plain.generate_ids(prompt) for t in s]
        b = [t for s in streamed.generate_ids(prompt) for t in s]
        assert a == b
        stats = streamed.stats()
        assert stats["kv"]["streamed_layers"] == 4 and stats["companion_bytes"] > 0 and not stats["kv"]["lossy"]
    finally:
        plain.engine.close()
        streamed.engine.close()


def test_cli_generate_kv_flags(capsys, tiny_pair, cache_root) -> None:
    argv = ["generate", "--model", str(tiny_pair[0]), "--no-draft", "--prompt", "Hello there", "--max-new-tokens",
            "6", "--offload", "ssd", "--quant", "none", "--cache-dir", str(cache_root), "--json"]
    assert main([*argv, "--kv-offload", "stream"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["stats"]["kv"]["streamed_layers"] == 4 and "target KV cache streamed with" in captured.err
    assert main([*argv, "--kv-quant", "int8"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["stats"]["kv"] == {**json.loads(captured.out)["stats"]["kv"], "quant": "int8",
                                                      "lossy": True}
    assert "LOSSY" in captured.err
    assert main([*argv, "--kv-quant", "int4"]) == 2
    assert "--kv-quant" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- int8 (lossy)

def test_int8_kv_is_off_by_default_and_close_not_exact(tiny_pair) -> None:
    """Off unless asked. With it, the target's logits after a 200-token prefix stay within a tolerance of
    the exact ones (a lossy format: no test here claims equality)."""
    assert EngineConfig().kv_quant == "none" and OffloadConfig().kv_offload == "auto"
    model = load_model(tiny_pair[0])
    ids = torch.randint(7, 300, (1, 200), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(200)[None]

    def logits(quant: str) -> torch.Tensor:
        cache = model.new_cache(256, quant)
        with torch.inference_mode():
            h = model(ids, pos, TreeMask(0), cache)
        return model.logits(h[:, -20:])

    exact, lossy = logits("none"), logits("int8")
    assert not torch.equal(exact, lossy)
    assert (lossy - exact).abs().mean() <= 0.05 * exact.abs().mean()      # ~3% on this random, peaked model
    assert (lossy.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


# ----------------------------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
def test_cuda_streamed_kv_is_exact_and_never_synchronizes(tiny_pair, tiny_perturbed_draft, cache_root,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (pinned host rows, the pager's copy stream, D2H write-back on the compute stream): greedy output
    with every streamed layer's KV streamed equals the device-KV run and the resident target; no device-wide
    or stream synchronize while generating; what moved is counted."""
    config = EngineConfig(budget=8, max_new_tokens=24, device="cuda", dtype="float32")
    common = {"quant": "none", "cache_dir": str(cache_root)}
    streamed = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config,
                            offload=OffloadConfig(offload="ram", kv_offload="stream", **common))
    device = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config,
                          offload=OffloadConfig(offload="ram", kv_offload="device", **common))
    resident = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config,
                            offload=OffloadConfig(offload="none", **common))
    prompt = streamed.encode("The quick brown fox jumps over the lazy dog. " * 8)
    try:
        list(streamed.generate_ids(prompt, 4))                   # warm-up
        calls: list[str] = []
        device_sync, stream_sync = torch.cuda.synchronize, torch.cuda.Stream.synchronize
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("device") or device_sync(*a, **k))
        monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: calls.append("stream") or stream_sync(self))
        got = [t for s in streamed.generate_ids(prompt, 24) for t in s]
        monkeypatch.undo()
        assert calls == []
        want = [t for s in device.generate_ids(prompt, 24) for t in s]
        assert got == want == [t for s in resident.generate_ids(prompt, 24) for t in s]
        cache = streamed.engine._caches[0]
        assert cache.streamed_layers == [0, 1, 2, 3] and is_pinned(cache.stream.host.data)
        assert streamed.stats()["companion_bytes"] > 0 and cache.stream.moved_out > 0
    finally:
        for rt in (streamed, device, resident):
            rt.engine.close()
