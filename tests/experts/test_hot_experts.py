"""Drafts for MoE targets: the self-draft whose copies of the streamed sparse layers hold H hot experts
(specexec/runtime/hot_experts.py, planning/hot_copy_sizes.py), a dense draft of the same tokenizer and a small MoE.

The router's mask: a row never goes to an expert the copy does not hold, and where the mask does not bind the
routing is the unmasked one. The copies: the dense part bound, H experts bound, the rest unbound (meta); the
draft's rows route only to held experts; re-ranking follows the routing counts (the copies change to the new
hottest, the bytes read are exactly the replaced experts'). Exactness: fp32 greedy ids equal the target alone's
for every MoE family streamed from RAM, and resident. The plan: per-copy bytes are the dense part plus H experts,
and `specexec plan --draft self` shows hot_experts_per_layer and hot_expert_bytes. Counts, never times.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specexec.checkpoints.catalog import SHIPPED_CONFIGS
from cli.main import main
from offload.streaming.storage import unpack_region
from specexec.checkpoints.naming import EXPERT_PREFIX
from specexec.builders.specexec import SpecExecBuilder
from specexec.checkpoints.loading import read_args
from specexec.config import EngineConfig, OffloadConfig
from specexec.network.model import Execution
from specexec.network.moe import Router, RoutingLog
from specexec.planning.hot_copy_sizes import copy_bytes, hot_per_layer
from specexec.planning.ledger import card_budget, plan_memory
from specexec.planning.run_shape import RunShape, with_self_draft
from specexec.planning.sizes import expert_split, layer_bytes
from specexec.planning.target import target_formats
from specexec.runtime.assembly import Runtime
from specexec.runtime.hot_experts import RERANK_PASSES, reranks_after
from tests.tiny_models import prompt, write_tiny_model

CONFIGS = SHIPPED_CONFIGS
GB = 10**9
F32 = EngineConfig(budget=8, dtype="float32")
HOT_CASES = 60


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hot-experts-cache")


def _load(target: Path, draft: str | None, offload: str, root: Path) -> Runtime:
    """An explicit RAM budget: the default (free RAM minus a margin) is 0 on a machine short of memory."""
    return Runtime.load(str(target), draft, F32, offload=OffloadConfig(offload=offload, quant="none",
                                                                     cache_dir=str(root), ram_budget=4 << 30))


def _equal_to_target_alone(rt: Runtime, seeds: tuple[int, ...] = (0, 1), n: int = 24) -> list[float]:
    """Asserts fp32 greedy ids with the draft equal the target alone's; returns tokens per step of each."""
    per_step = []
    for seed in seeds:
        ids = prompt(seed)
        got = [t for s in rt.generate_ids(ids, n) for t in s]
        per_step.append(rt.stats()["tokens_per_step"])
        want = [t for s in rt.variant(F32, use_draft=False).generate_ids(ids, n) for t in s]
        assert got == want, f"seed {seed}"
    return per_step


# ----------------------------------------------------------------------------------------- the mask

@pytest.mark.parametrize("seed", [0, 1])
def test_the_router_never_chooses_an_expert_it_does_not_allow(tiny_moe: Path, seed: int) -> None:
    """Every family's router (softmax with and without renormalising, softmax over the top-k, a biased one,
    sigmoid scores chosen with a score bias and among the best expert groups):
    with a random allowed set of 2 top-k experts no row goes elsewhere; all allowed is the unmasked routing;
    a row whose unmasked top-k is allowed routes as unmasked; renormalising routers' weights still sum to 1
    (times routed_scaling_factor; each divided by its expert's scale where the router has them)."""
    args = read_args(tiny_moe)
    m = args.moe
    g = torch.Generator().manual_seed(seed)
    router = Router(args)
    with torch.no_grad():
        for param in router.parameters():                            # weight, bias, score bias
            param.copy_(torch.randn(param.shape, generator=g))
    x = torch.randn(64, args.dim, generator=g)
    free = router(x)
    router.allowed = torch.ones(m.n_experts, dtype=torch.bool)
    same = router(x)
    assert torch.equal(same.index, free.index) and torch.equal(same.weight, free.weight)
    allowed = torch.zeros(m.n_experts, dtype=torch.bool)
    allowed[free.index[0]] = True                                    # row 0's own top-k, then random others
    for e in torch.randperm(m.n_experts, generator=g).tolist():
        if int(allowed.sum()) < min(2 * m.top_k, m.n_experts):
            allowed[e] = True
    router.allowed = allowed
    masked = router(x)
    assert bool(allowed[masked.index].all()) and masked.index.shape == free.index.shape
    inside = allowed[free.index].all(dim=-1)                        # rows the mask does not bind
    assert inside[0] and (bool(allowed.all()) or not bool(inside.all()))
    assert torch.equal(masked.index[inside], free.index[inside])
    assert torch.allclose(masked.weight[inside], free.weight[inside])
    if router.kind == "topk_softmax" or router.norm_topk:               # (times routed_scaling_factor)
        w = masked.weight                                               # (and Gemma 4's per-expert scales)
        w = w / router.per_expert_scale[masked.index] if hasattr(router, "per_expert_scale") else w
        assert torch.allclose(w.sum(-1), torch.full((64,), router.routed_scale), atol=1e-5)


# ----------------------------------------------------------------------------------------- the copies

def test_copies_hold_their_hot_experts_and_the_draft_routes_only_to_them(tiny_qwen3_moe: Path,
                                                                         cache_root: Path) -> None:
    """--offload ram: every sparse layer the draft runs is a hot copy of H = 2 top-k = 8 of 16 experts (the
    dense layer a whole copy); held experts are bound, the others unbound; a draft forward routes each copy's
    rows to held experts only, and the copies' device bytes are the dense parts plus H experts each."""
    rt = _load(tiny_qwen3_moe, "self", "ram", cache_root)
    try:
        draft, args = rt.engine.draft, read_args(tiny_qwen3_moe)
        hot = draft.hot
        assert hot is not None and hot.layers == (0, 2) and hot.per_layer == hot_per_layer(args) == 8
        assert "8 hot experts per MoE copy" in draft.describe()
        lay = hot.cache.layout(0)
        assert hot.nbytes() == 2 * (lay.dense_nbytes + 8 * lay.regions[0].nbytes)
        for i in hot.layers:
            experts = hot.blocks[i].mlp.experts
            bound = [e for e in range(16) if experts[e].gate_proj.wmeta is not None]
            assert sorted(bound) == sorted(hot.held[i]) and len(bound) == 8
            assert torch.equal(hot.blocks[i].mlp.router.allowed.nonzero().flatten(), torch.tensor(sorted(bound)))
        draft.run_as(Execution(routing=RoutingLog()))
        ids = torch.tensor([prompt(5, 40)])
        with torch.inference_mode():
            draft(ids, torch.arange(ids.shape[1])[None])
        for j, i in enumerate(draft.layer_ids):
            if i in hot.layers:
                assert set(draft.routing.layers[j].flatten().tolist()) <= set(hot.held[i])
        draft.run_as(Execution())
    finally:
        rt.engine.close()


def test_reranking_follows_the_routing_counts(tiny_qwen3_moe: Path, cache_root: Path) -> None:
    """The first pass re-ranks: counts that make experts 8..15 the hottest put exactly those in each copy, the
    experts that left are unbound, and the bytes read are the newcomers' alone. Then nothing changes before
    pass RERANK_PASSES, which follows counts that make 0..7 the hottest again; counts that keep the held ones
    hottest replace nothing."""
    rt = _load(tiny_qwen3_moe, "self", "ram", cache_root)
    try:
        hot = rt.engine.draft.hot
        layers = (0, 2)
        assert all(sorted(h) == list(range(8)) for h in hot.held.values())     # before any pass: 0 .. H-1
        up = torch.arange(16, dtype=torch.float64).repeat(2, 1)                 # expert e counted e times
        read0 = hot.counters["hot_expert_bytes_read"]
        assert hot.observe(up, layers)                                          # pass 1 re-ranks
        each = hot.cache.layout(0).regions[0].nbytes
        for i in layers:
            assert sorted(hot.held[i]) == list(range(8, 16))
            assert all(hot.blocks[i].mlp.experts[e].gate_proj.wmeta is None for e in range(8))
            assert hot.blocks[i].mlp.router.allowed.tolist() == [False] * 8 + [True] * 8
        assert hot.counters["hot_experts_replaced"] == 16
        assert hot.counters["hot_expert_bytes_read"] - read0 == 16 * each
        after_first = {i: list(h) for i, h in hot.held.items()}
        down = up.flip(-1)                                                      # now 0..7 are the hottest
        for k in range(2, RERANK_PASSES):
            assert not hot.observe(down, layers) and hot.held == after_first
        assert hot.observe(down, layers)                                        # pass RERANK_PASSES
        assert all(sorted(hot.held[i]) == list(range(8)) for i in layers)
        assert hot.counters["hot_experts_replaced"] == 32
        entries = {i: list(h) for i, h in hot.held.items()}
        for _ in range(RERANK_PASSES):
            hot.observe(down, layers)
        assert hot.held == entries and hot.counters["hot_experts_replaced"] == 32
    finally:
        rt.engine.close()


def test_a_run_reranks_from_the_targets_routing(tiny_qwen3_moe: Path, cache_root: Path) -> None:
    """In a run the engine's routing statistics reach the draft after every target pass: a re-ranking after the
    first pass and every RERANK_PASSES after it,
    after the last each copy holds the hottest experts of the target's counts then, and stats.moe says the
    expert bytes the re-rankings read per pass."""
    rt = _load(tiny_qwen3_moe, "self", "ram", cache_root)
    try:
        hot, seen = rt.engine.draft.hot, {}
        held_then = {}

        def snapshot(counts: torch.Tensor, layers: tuple[int, ...]) -> None:      # runs after the draft's
            if reranks_after(hot.passes):
                seen["counts"] = counts.clone()
                held_then.update({i: sorted(h) for i, h in hot.held.items()})

        rt.engine.experts.listeners.append(snapshot)
        loaded = hot.counters["hot_expert_bytes_read"]
        list(rt.generate_ids(prompt(3), 24))
        passes = rt.engine.experts.routing.passes
        assert passes > RERANK_PASSES and hot.counters["hot_reranks"] == 1 + passes // RERANK_PASSES
        moe = rt.stats()["moe"]                  # stats.moe: the re-reads per pass (the first load is not one)
        assert moe["passes"] == passes
        assert moe["draft_expert_bytes_per_pass"] == round((hot.counters["hot_expert_bytes_read"] - loaded) / passes, 1)
        for j, i in enumerate(rt.engine.experts.layers):
            top = torch.sort(-seen["counts"][j], stable=True).indices[:8].tolist()
            assert held_then[i] == sorted(top)
        assert hot.counters["hot_experts_replaced"] > 0
    finally:
        rt.engine.close()


# ----------------------------------------------------------------------------------------- exactness

def test_self_draft_streamed_from_ram_equals_the_target_alone(tiny_moe: Path, cache_root: Path) -> None:
    """Every MoE family, every layer streamed from RAM, the self-draft over hot copies: fp32 greedy ids equal
    the target alone's."""
    rt = _load(tiny_moe, "self", "ram", cache_root)
    try:
        assert rt.engine.draft.hot is not None
        _equal_to_target_alone(rt)
    finally:
        rt.engine.close()


def test_self_draft_of_a_resident_moe_target_equals_the_target_alone(tiny_qwen3_moe: Path, cache_root: Path) -> None:
    """A resident target: the draft's layers are the target's own Blocks (no copies, no mask)."""
    rt = _load(tiny_qwen3_moe, "self", "none", cache_root)
    try:
        assert rt.engine.draft.hot is None and not rt.engine.draft.copies
        _equal_to_target_alone(rt)
    finally:
        rt.engine.close()


@pytest.mark.parametrize("offload", ["ram", "none"])
def test_a_dense_draft_and_a_small_moe_draft_equal_the_target_alone(tiny_qwen3_moe: Path, tiny_llama: Path,
                                                                    tiny_root: Path, cache_root: Path,
                                                                    offload: str) -> None:
    """A dense Llama of the same tokenizer and an unrelated one-layer Qwen3-MoE as drafts of the streamed and
    the resident MoE target: fp32 greedy ids equal the target alone's."""
    small = tiny_root / "moe-qwen3_moe-small"
    if not small.exists():
        write_tiny_model(small, "qwen3_moe", seed=31, n_layers=1)
    for draft in (tiny_llama, small):
        rt = _load(tiny_qwen3_moe, str(draft), offload, cache_root)
        try:
            assert (rt.engine.draft.args.moe is None) == (draft == tiny_llama)
            _equal_to_target_alone(rt, (0,))
        finally:
            rt.engine.close()


def test_generate_self_on_a_streamed_moe_equals_no_draft(capsys, tiny_qwen3_moe: Path, cache_root: Path) -> None:
    common = ["generate", "--model", str(tiny_qwen3_moe), "--dtype", "float32", "--quant", "none", "--offload",
              "ram", "--max-new-tokens", "16", "--prompt", "The quick brown fox", "--json", "--cache-dir",
              str(cache_root)]
    assert main([*common, "--no-draft"]) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*common, "--draft", "self"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["token_ids"] == want
    assert "8 hot experts per MoE layer copy" in captured.err


# ----------------------------------------------------------------------------------------- the plan

@pytest.mark.parametrize("name,gpu,ram,h", [("gpt-oss-120b", 24, 128, 8), ("qwen3-30b-a3b", 8, 64, 16)])
def test_the_plan_counts_each_copy_as_its_dense_part_and_h_experts(name: str, gpu: int, ram: int, h: int) -> None:
    """From config.json alone: H = 2 top-k; the draft weights line is the copies' bytes, each sparse copy its
    dense part plus H experts (far less than the layer); hot_expert_bytes the experts' share."""
    args = read_args(CONFIGS / name)
    shape = RunShape(args, None, torch.bfloat16, "cuda", 64, 4096, draft_kv=SpecExecBuilder().kv_slots)
    m = plan_memory(with_self_draft(shape, "nf4", None), target_formats("nf4", "cuda"), ram * GB,
                    card_budget(gpu * GB))
    sd = m.self_json()
    dense, each = expert_split(args, "nf4", torch.bfloat16, "cuda", 0)
    assert sd["hot_experts_per_layer"] == h == hot_per_layer(args)
    assert copy_bytes(args, "nf4", torch.bfloat16, "cuda", 0) == dense + h * each
    assert dense + h * each < layer_bytes(args, "nf4", torch.bfloat16, "cuda", 0) / 4
    assert sd["copies"] and sd["hot_layers"] == len(sd["copies"])
    assert sd["hot_expert_bytes"] == len(sd["copies"]) * h * each
    assert sd["copy_bytes"] == len(sd["copies"]) * (dense + h * each) <= m.ledger()["draft weights"]


def test_specexec_plan_shows_the_hot_experts(capsys) -> None:
    code = main(["plan", "--model", str(CONFIGS / "gpt-oss-120b"), "--draft", "self", "--quant", "nf4",
                 "--gpu-memory", "24GB", "--ram-budget", "128GB", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    sd = json.loads(out)["self_draft"]
    assert sd["hot_experts_per_layer"] == 8 and sd["hot_expert_bytes"] > 0
    code = main(["plan", "--model", str(CONFIGS / "gpt-oss-120b"), "--draft", "self", "--quant", "nf4",
                 "--gpu-memory", "24GB", "--ram-budget", "128GB"])
    text = capsys.readouterr().out
    assert code == 0 and "8 hot experts per MoE layer copy" in text and "8 hot experts each" in text


@pytest.mark.gpu
def test_on_cuda_the_hot_copies_live_on_the_gpu_and_stay_exact(tiny_qwen3_moe: Path, cache_root: Path) -> None:
    """CUDA: the copies' dense parts and expert entries are on the GPU (read through the host bounce buffer,
    re-ranked the same way), and fp32 greedy ids equal the target alone's."""
    config = EngineConfig(budget=8, dtype="float32", device="cuda")
    rt = Runtime.load(str(tiny_qwen3_moe), "self", config,
                      offload=OffloadConfig(offload="ram", quant="none", cache_dir=str(cache_root)))
    try:
        hot = rt.engine.draft.hot
        assert hot is not None and hot.fmt == "nf4"
        assert all(t.device.type == "cuda" for t in (*hot._dense.values(), *hot._entries.values()))
        ids = prompt(2)
        got = [t for s in rt.generate_ids(ids, 24) for t in s]
        assert got == [t for s in rt.variant(config, use_draft=False).generate_ids(ids, 24) for t in s]
        assert hot.counters["hot_reranks"] >= 1
    finally:
        rt.engine.close()


# ----------------------------------------------------------------------------------------- the copies as a property

def held_bytes_are_their_own(hot, i: int) -> None:
    """Every expert layer i's copy allows holds its own region's bytes (read afresh from the layer cache); every
    other expert is unbound."""
    lay, block = hot.cache.layout(i), hot.blocks[i]
    held = {e for e in hot.held[i] if e >= 0}
    assert set(torch.nonzero(block.mlp.router.allowed).flatten().tolist()) == held
    for e in range(hot.args.moe.n_experts):
        module = block.mlp.experts[e]
        if e not in held:
            assert module.gate_proj.wmeta is None, f"layer {i}: expert {e} left but is still bound"
            continue
        name = f"{EXPERT_PREFIX}{e}."
        fresh = torch.empty(lay.region(name).nbytes, dtype=torch.uint8)
        hot.cache.read_region(i, name, fresh)
        want = unpack_region(fresh, lay, name)
        for n, t in module.named_buffers():
            proj, field = n.split(".")
            assert torch.equal(t, want[f"{name}{proj}.weight.{field}"]), f"layer {i} expert {e} {n}"


@pytest.mark.slow
def test_after_every_reranking_each_held_expert_holds_its_own_bytes(tiny_qwen3_moe: Path, cache_root: Path) -> None:
    """Random routing counts, pass after pass (re-rankings replace some experts, keep others in their entries): an
    entry refilled for a newcomer is never still bound to the expert that left it, and every held one's bytes are
    its own (hypothesis, HOT_CASES sequences)."""
    pytest.importorskip("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    rt = _load(tiny_qwen3_moe, "self", "ram", cache_root)
    hot, layers = rt.engine.draft.hot, (0, 2)
    counts = st.lists(st.lists(st.integers(0, 5), min_size=16, max_size=16), min_size=2, max_size=2)

    @settings(max_examples=HOT_CASES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(passes=st.lists(counts, min_size=1, max_size=2 * RERANK_PASSES))
    def check(passes: list[list[list[int]]]) -> None:
        for c in passes:
            hot.observe(torch.tensor(c, dtype=torch.float64), layers)
            for i in layers:
                held_bytes_are_their_own(hot, i)

    try:
        check()
        assert hot.counters["hot_experts_replaced"] > 0
    finally:
        rt.engine.close()
