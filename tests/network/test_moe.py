"""Mixture-of-experts targets against transformers' own implementation of the same tiny checkpoints (fp32).

Per MoE family (tests/conftest.py MOE_MODELS): logits of a prefill, a cached decode step and the no-cache path;
a tree forward whose every node equals transformers on its root-to-node path, with the split prefix/tree
attention and with a dense mask; and greedy ids equal to transformers' `generate` through the whole runtime,
without a draft and with one, resident and with every layer streamed from the SSD tier. Also the block's own
contract for streaming (specexec/network/moe.py): routing first, recorded per sparse layer, then experts; the grouped
expert computation equals a per-row reference; quantized experts streamed equal the same quantization resident.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from specexec.checkpoints.catalog import SHIPPED_CONFIGS
from specexec.config import EngineConfig, ModelArgs, MoEArgs, OffloadConfig
from specexec.network.model import Block, Execution, Transformer, TreeMask
from specexec.network.moe import GatedMLP, Routing, RoutingLog, SparseMLP
from specexec.runtime.assembly import Runtime
from specexec.checkpoints.loading import load_model
from specexec.tree import TokenTree
from tests.network.model_reference import TOL, TREE_PARENTS, hf_model, new_cache, prefill
from tests.tiny_models import DRAFT_PERTURB, write_tiny_model

PROMPT = "The quick brown fox"
N_NEW = 24


@torch.inference_mode()
def test_logits_match_transformers(tiny_moe: Path) -> None:
    ours, ref = load_model(tiny_moe), hf_model(tiny_moe)
    assert ours.args.moe is not None
    ids = torch.randint(0, ours.args.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    want = ref(ids[None]).logits[0]
    cache = new_cache(ours)
    assert (prefill(ours, cache, ids[:-1]) - want[:-1]).abs().max() < TOL
    assert (prefill(ours, cache, ids[-1:]) - want[-1:]).abs().max() < TOL
    assert (ours.logits(ours(ids[None], torch.arange(24)[None])) - want).abs().max() < TOL


@torch.inference_mode()
@pytest.mark.parametrize("dense", [False, True], ids=["split", "dense"])
def test_tree_forward_equals_each_path(tiny_moe: Path, dense: bool) -> None:
    from specexec.network.model import prefix_tree_mask

    ours, ref = load_model(tiny_moe), hf_model(tiny_moe)
    if dense and len({k.window for k in ours.args.layer_kinds}) > 1:
        pytest.skip("one dense mask cannot serve layers with different windows (TreeMask only)")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, ours.args.vocab_size, (10,), generator=g)
    tree = TokenTree.from_lists(torch.randint(0, ours.args.vocab_size, (len(TREE_PARENTS),), generator=g).tolist(),
                                TREE_PARENTS)
    cache = new_cache(ours)
    prefill(ours, cache, prompt, dense)
    L = cache.length
    mask = prefix_tree_mask(L, tree.ancestor_mask()) if dense else TreeMask(L, tree.ancestor_mask())
    got = ours.logits(ours(tree.tokens[None], tree.positions(L)[None], mask, cache))
    for node in range(len(TREE_PARENTS)):
        path = torch.cat([prompt, tree.tokens[tree.path(node)]])
        assert (got[node] - ref(path[None]).logits[0, -1]).abs().max() < TOL, f"node {node}"


def hf_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    model = hf_model(path)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def runtime_ids(target: Path, draft: Path | None, offload: str, cache_root: Path, kv: str = "auto"
                ) -> tuple[list[int], list[int], Runtime]:
    rt = Runtime.load(str(target), str(draft) if draft else None, EngineConfig(budget=8, max_new_tokens=N_NEW),
                      offload=OffloadConfig(offload=offload, quant="none", cache_dir=str(cache_root), kv_offload=kv))
    ids = rt.encode(PROMPT)
    return ids, [t for step in rt.generate_ids(ids, N_NEW) for t in step], rt


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("moe-layer-cache")


def test_greedy_equals_transformers_generate(tiny_moe: Path, tiny_root: Path, cache_root: Path) -> None:
    """--no-draft and an MoE draft (a perturbed copy of the target), resident and every layer on the SSD tier
    (with the draft: the KV rows streamed with their layers too): the ids transformers' generate gives."""
    draft = write_tiny_model(tiny_root / f"{tiny_moe.name}-draft", perturb=DRAFT_PERTURB, base=tiny_moe, seed=30)
    ids, want, _ = runtime_ids(tiny_moe, None, "none", cache_root)
    assert want == hf_greedy(tiny_moe, ids, N_NEW) and len(want) > 4
    for offload in ("none", "ssd"):
        for d in (None, draft):
            kv = "stream" if offload == "ssd" and d is not None else "auto"
            _, got, rt = runtime_ids(tiny_moe, d, offload, cache_root, kv)
            assert got == want, f"offload={offload} draft={d}"
            if d is not None:
                assert rt.stats()["tokens_per_step"] > 1.5          # the draft's trees were accepted
            if offload == "ssd":
                assert rt.plan.plan.layers_in("ssd") == list(range(rt.engine.target.args.n_layers))


def test_a_dense_draft_serves_an_moe_target(tiny_qwen3_moe: Path, tiny_llama: Path, cache_root: Path) -> None:
    """A dense Llama draft of the same tokenizer drafts for the Qwen3-MoE target: nothing refuses it, and the
    output is the target's own."""
    ids, want, _ = runtime_ids(tiny_qwen3_moe, None, "none", cache_root)
    _, got, rt = runtime_ids(tiny_qwen3_moe, tiny_llama, "none", cache_root)
    assert got == want and rt.engine.draft.args.moe is None and rt.engine.target.args.moe is not None


# ------------------------------------------------------------------------------------ the block's contract

def tiny_args(**moe: object) -> ModelArgs:
    kw = dict(n_experts=8, top_k=3, expert_dim=16) | moe
    return ModelArgs(family="test", vocab_size=32, dim=24, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=12,
                     intermediate_size=40, moe=MoEArgs(**kw))


def randomized(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module.eval()


@pytest.mark.parametrize("moe", [{}, {"router": "topk_softmax", "router_bias": True, "expert_bias": True,
                                      "activation": "clamped_swiglu", "swiglu_limit": 0.5},
                                 {"router": "sigmoid", "norm_topk_prob": False, "shared_dim": 20, "shared_gate": True}],
                         ids=["softmax", "gpt-oss-like", "sigmoid-shared"])
@torch.inference_mode()
def test_grouped_experts_equal_a_per_row_reference(moe: dict) -> None:
    """Each row: sum over its top-k experts of weight x expert(row) (+ the gated shared expert), computed row by
    row here; the block's grouped computation (one call per expert hit) gives the same."""
    args = tiny_args(**moe)
    mlp = randomized(SparseMLP(args))
    h = torch.randn(2, 7, args.dim, generator=torch.Generator().manual_seed(1))
    routing = mlp.route(h)
    assert routing.index.shape == (14, args.moe.top_k) and routing.weight.shape == (14, args.moe.top_k)
    want = torch.zeros(14, args.dim)
    for t, row in enumerate(h.reshape(14, -1)):
        for e, w in zip(routing.index[t].tolist(), routing.weight[t]):
            want[t] += w * mlp.experts[e](row)
        if args.moe.shared_dim:
            want[t] += mlp.shared_expert_gate(row) * mlp.shared_expert(row)
    assert torch.allclose(mlp(h).reshape(14, -1), want, atol=1e-5)
    if args.moe.router == "topk_softmax":                    # softmax over the kept logits: the weights sum to 1
        assert torch.allclose(routing.weight.sum(-1), torch.ones(14))


@torch.inference_mode()
def test_routing_is_recorded_per_sparse_layer_before_the_experts_run() -> None:
    """Execution(routing=RoutingLog()): each sparse layer's [T, k] index, recorded between its router and its
    experts (a subclass sees it before any expert computes); dense layers record nothing."""
    args = tiny_args(dense_layers=(1,))
    model = randomized(Transformer(args))
    assert isinstance(model.layers[1].mlp, GatedMLP) and isinstance(model.layers[0].mlp, SparseMLP)
    calls: list[str] = []

    class Log(RoutingLog):
        def record(self, layer: int, routing: Routing) -> None:
            calls.append(f"route {layer}")
            super().record(layer, routing)

    for i in (0, 2):
        model.layers[i].mlp.experts[0].register_forward_pre_hook(lambda *_, i=i: calls.append(f"expert {i}"))
    model.run_as(Execution(routing=Log()))
    tokens = torch.arange(5)[None] + 3
    model(tokens, torch.arange(5)[None])
    assert sorted(model.routing.layers) == [0, 2] and model.routing.layers[0].shape == (5, 3)
    first_expert = [c for c in calls if c.startswith("expert 0")][:1]
    assert calls.index("route 0") < (calls.index(first_expert[0]) if first_expert else len(calls))
    assert model.routing.experts(0) == sorted(set(model.routing.layers[0].flatten().tolist()))
    model.run_as(Execution())
    assert torch.equal(model(tokens, torch.arange(5)[None]), model(tokens, torch.arange(5)[None]))


def test_block_names_are_the_documented_contract() -> None:
    names = set(Block(tiny_args(router_bias=True, expert_bias=True, shared_dim=8, shared_gate=True), 0).state_dict())
    assert {"mlp.router.weight", "mlp.router.bias", "mlp.experts.7.gate_proj.weight", "mlp.experts.7.up_proj.bias",
            "mlp.experts.0.down_proj.weight", "mlp.shared_expert.up_proj.weight",
            "mlp.shared_expert_gate.weight"} <= names
    assert "mlp.gate_proj.weight" in Block(tiny_args(dense_layers=(1,)), 1).state_dict()


@torch.inference_mode()
def tree_pass(model: Transformer) -> torch.Tensor:
    """Hidden states of a 12-token prefill and then a tree over it (split attention: TreeMask)."""
    g = torch.Generator().manual_seed(2)
    cache = new_cache(model, 64)
    prefill_h = model(torch.randint(7, 300, (1, 12), generator=g), torch.arange(12)[None], TreeMask(0), cache)
    cache.advance(12)
    tree = TokenTree.from_lists(torch.randint(7, 300, (len(TREE_PARENTS),), generator=g).tolist(), TREE_PARENTS)
    tree_h = model(tree.tokens[None], tree.positions(12)[None], TreeMask(12, tree.ancestor_mask()), cache)
    return torch.cat([prefill_h, tree_h], dim=1)


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_quantized_experts_streamed_equal_the_same_quantization_resident(tiny_moe: Path, cache_root: Path,
                                                                         fmt: str) -> None:
    """Experts are nn.Linear inside the layer, so swap_linears/QuantLinear quantize them like any MLP (the router
    stays unquantized); a whole MoE layer streams as one packed layer through the RAM and SSD tiers."""
    from offload.quant.linear import QuantLinear
    from tests.runtime.offloaded_models import offloaded, reference

    want = tree_pass(reference(tiny_moe, fmt))
    tiers = ["ssd", "ram", "ssd"][:load_model(tiny_moe).args.n_layers]
    model = offloaded(tiny_moe, fmt, tiers, cache_root)
    try:
        assert torch.equal(tree_pass(model), want)
        layer = next(block for _, block in model.layer_modules() if isinstance(block.mlp, SparseMLP))
        assert isinstance(layer.mlp.experts[0].up_proj, QuantLinear)
        assert isinstance(layer.mlp.router.weight, torch.nn.Parameter)
    finally:
        model.close()


# ------------------------------------------------------------------------------------ attention sinks

def sink_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, sinks: torch.Tensor
                   ) -> torch.Tensor:
    """transformers' eager gpt-oss attention in fp64: the sink logit as one more column of every row's softmax,
    dropped after it. q [1, H, T, D], k/v [1, H_kv, S, D], seen bool [T, S], sinks [H]."""
    H, G = q.shape[1], q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    scores = (q.double() @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~seen, float("-inf"))
    sink = sinks.double().view(1, H, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    return probs @ vv


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window-6"])
@pytest.mark.parametrize("kernel", ["cpu", "math"])
def test_sinks_enter_the_split_attention_once(window: int | None, kernel: str) -> None:
    """Prefix part(s) and tree part attended apart and merged with the sink in the denominator equal one
    softmax over every key plus the sink; also a one-part plan (a one-token decode) and a prefill chunk."""
    from specexec.network.attention import TreeMask, attend, build_plan

    g = torch.Generator().manual_seed(3)
    H, Hkv, D, P = 4, 2, 16, 20
    tree = TokenTree.from_lists(list(range(len(TREE_PARENTS))), TREE_PARENTS)
    sinks = torch.randn(H, generator=g) * 2
    for anc, pos in ((tree.ancestor_mask(), tree.positions(P)), (None, torch.arange(P, P + 5)),
                     (None, torch.tensor([P]))):
        T = pos.numel()
        K = T if anc is None else anc.shape[1]
        q = torch.randn(1, H, T, D, generator=g)
        k, v = torch.randn(1, Hkv, P + K, D, generator=g), torch.randn(1, Hkv, P + K, D, generator=g)
        plan = build_plan(TreeMask(P, anc), pos[None], T, window, H // Hkv, torch.float32, kernel)
        own = anc if anc is not None else torch.ones(T, T, dtype=torch.bool).tril()
        seen = torch.cat([torch.ones(T, P, dtype=torch.bool), own], 1)
        if window is not None:
            keys = torch.cat([torch.arange(P), pos if anc is None else tree.positions(P)])
            seen &= (pos[:, None] - keys[None]) < window
        got = attend(q, k, v, plan, sinks)
        assert (got.double() - sink_reference(q, k, v, seen, sinks)).abs().max() < 1e-5, (T, len(plan.parts))
        assert (attend(q, k, v, plan) - got).abs().max() > 1e-3          # the sinks do change the output


def test_mxfp4_gpt_oss_equals_transformers(tiny_gpt_oss_mxfp4: Path, cache_root: Path) -> None:
    """The Hub's gpt-oss layout (experts in MXFP4, dequantized exactly): greedy ids equal transformers' generate
    on the same checkpoint, resident and streamed from the SSD tier (cache built from the dequantized experts)."""
    ids, want, _ = runtime_ids(tiny_gpt_oss_mxfp4, None, "none", cache_root)
    assert want == hf_greedy(tiny_gpt_oss_mxfp4, ids, N_NEW)
    assert runtime_ids(tiny_gpt_oss_mxfp4, None, "ssd", cache_root)[1] == want


# Published config.json files (specexec/checkpoints/configs, as the Hub serves them) and their parameter counts as published.
REAL_MOE = {"mixtral-8x7b-instruct-v0.1": ("mixtral", 8, 2, 46.7e9), "gpt-oss-120b": ("gpt_oss", 128, 4, 116.8e9),
            "qwen3-235b-a22b": ("qwen3_moe", 128, 8, 235e9), "qwen3-30b-a3b": ("qwen3_moe", 128, 8, 30.5e9),
            "glm-4.5-air": ("glm4_moe", 128, 8, 106e9), "glm-4.6": ("glm4_moe", 160, 8, 355e9),
            "minimax-m2": ("minimax_m2", 256, 8, 230e9), "deepseek-v3": ("deepseek_v3", 256, 8, 671e9),
            "kimi-k2-instruct": ("deepseek_v3", 384, 8, 1.026e12)}


@pytest.mark.parametrize("name", list(REAL_MOE))
def test_published_moe_configs_read_as_their_family(name: str) -> None:
    import json

    from specexec.families import model_args
    from specexec.planning.sizes import weight_bytes

    family, experts, top_k, params = REAL_MOE[name]
    cfg = json.loads((SHIPPED_CONFIGS / name / "config.json").read_text())
    args = model_args(cfg)
    assert (args.family, args.moe.n_experts, args.moe.top_k) == (family, experts, top_k)
    total = sum(weight_bytes(args, "none", torch.bfloat16).values()) / 2
    assert abs(total - params) / params < 0.01, total


def test_an_moe_draft_is_never_captured_in_a_cuda_graph() -> None:
    """Its experts depend on each pass's routing (a host sync per sparse layer): a replay would run the captured
    ones, so the draft runs eagerly (checked on the model's options; graphs exist on CUDA only)."""
    from specexec.builders.draft_graphs import capturable

    dense = dataclasses.replace(tiny_args(), moe=None)
    assert capturable(Transformer(dense)) and not capturable(Transformer(tiny_args()))


def test_the_planned_size_of_each_layer_is_what_the_cache_packs(tiny_qwen3_moe: Path, cache_root: Path) -> None:
    """A dense layer among routed ones is planned at its own size (the ledger's per-layer sizes), equal to the
    packed bytes the layer cache writes for it."""
    from specexec.checkpoints.loading import read_args
    from specexec.planning.sizes import layer_sizes
    from tests.runtime.offloaded_models import open_cache

    args = read_args(tiny_qwen3_moe)
    cache = open_cache(tiny_qwen3_moe, "int8", cache_root)
    planned = layer_sizes(args, "int8", torch.float32, "cpu")
    assert list(planned) == [cache.nbytes(i) for i in range(args.n_layers)]
    assert planned[1] != planned[0] == planned[2]                    # layer 1 is the dense one
