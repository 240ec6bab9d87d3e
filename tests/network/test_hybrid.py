"""Hybrid linear-attention models (Qwen3.5 dense and MoE, its multimodal checkpoint's text decoder, Qwen3-Next:
Gated DeltaNet layers with a recurrent state, one gated full-attention layer in four) against transformers on
tiny checkpoints (fp32), and the state per tree branch (specexec/network/linear_attention.py,
specexec/kv/recurrent.py, docs/algorithms.md §30).

Per family: logits of a prefill (no cache, and cached then one-token decodes); a tree pass whose every node equals
transformers on its own root-to-node path (siblings never leak into each other's state); committing an accepted
path then decoding; a tree grown over several passes as a draft grows it; greedy ids equal to transformers'
`generate` through the whole runtime, without a draft, with a hybrid draft, resident and with every layer on the
SSD tier, and with `--draft self` and a dense draft of the same tokenizer. The full builder matrix and the
32k-token chunked prefill are `slow`.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specexec.checkpoints.loading import load_model
from specexec.config import EngineConfig, OffloadConfig
from specexec.kv.recurrent import RecurrentSpec, RecurrentStates
from specexec.network.delta_rule import advance_state
from specexec.network.model import Transformer, TreeMask
from specexec.runtime.assembly import Runtime
from specexec.tree import TokenTree
from tests.network.model_reference import TREE_PARENTS, hf_model
from tests.tiny_models import DRAFT_PERTURB, write_tiny_model

PROMPT = "The quick brown fox"
N_NEW = 24
BUILDERS = ("specexec", "chain", "static", "dynamic", "optree", "rsd", "recycling")
# Logits reach |35| here and the delta rule sums in another order than transformers' chunked form (its UT solve
# over chunks of 64, ours over the pass's nodes): agreement to ~1e-5 relative, so 5e-4 absolute.
TOL = 5e-4


def prefill(model: Transformer, cache, ids: torch.Tensor) -> torch.Tensor:
    T, L = ids.numel(), cache.length
    hidden = model(ids[None], torch.arange(L, L + T)[None], TreeMask(L), cache)
    cache.advance(T)
    return model.logits(hidden)


def tree_pass(model: Transformer, cache, tree: TokenTree) -> torch.Tensor:
    L = cache.length
    return model.logits(model(tree.tokens[None], tree.positions(L)[None], TreeMask(L, tree.ancestor_mask()), cache))


def random_tree(seed: int, vocab: int) -> TokenTree:
    g = torch.Generator().manual_seed(seed)
    return TokenTree.from_lists(torch.randint(7, vocab, (len(TREE_PARENTS),), generator=g).tolist(), TREE_PARENTS)


@torch.inference_mode()
def test_logits_match_transformers(tiny_hybrid: Path) -> None:
    ours, ref = load_model(tiny_hybrid), hf_model(tiny_hybrid)
    assert "linear_attention" in ours.args.layer_types and ours.args.linear is not None
    ids = torch.randint(7, ours.args.vocab_size, (70,), generator=torch.Generator().manual_seed(0))
    want = ref(ids[None]).logits[0]
    assert (ours.logits(ours(ids[None], torch.arange(70)[None])) - want).abs().max() < TOL
    cache = ours.new_cache(96)
    assert (prefill(ours, cache, ids[:66]) - want[:66]).abs().max() < TOL     # two chunks of the causal form
    for t in range(66, 70):
        assert (prefill(ours, cache, ids[t:t + 1]) - want[t]).abs().max() < TOL


@torch.inference_mode()
def test_tree_nodes_see_their_own_path_only(tiny_hybrid: Path) -> None:
    """Every node of a tree pass equals transformers on prompt + its root-to-node path."""
    ours, ref = load_model(tiny_hybrid), hf_model(tiny_hybrid)
    prompt = torch.randint(7, 300, (10,), generator=torch.Generator().manual_seed(1))
    tree = random_tree(2, ours.args.vocab_size)
    cache = ours.new_cache(64)
    prefill(ours, cache, prompt)
    got = tree_pass(ours, cache, tree)
    for node in range(len(TREE_PARENTS)):
        path = torch.cat([prompt, tree.tokens[tree.path(node)]])
        assert (got[node] - ref(path[None]).logits[0, -1]).abs().max() < TOL, f"node {node}"


@torch.inference_mode()
def test_keep_commits_the_accepted_path(tiny_qwen3_5: Path) -> None:
    """After a tree pass, keep(root + a path) leaves the state of prompt + path: the next decode is
    transformers' on it; the rejected branches leave no trace. Twice, so a commit from a committed state works."""
    ours, ref = load_model(tiny_qwen3_5), hf_model(tiny_qwen3_5)
    context = torch.randint(7, 300, (9,), generator=torch.Generator().manual_seed(3))
    cache = ours.new_cache(64)
    prefill(ours, cache, context)
    for seed, leaf in ((4, 7), (5, 6)):
        tree = random_tree(seed, ours.args.vocab_size)
        tree_pass(ours, cache, tree)
        path = tree.path(leaf)                                    # root ... leaf, node ids ascending
        cache.keep(cache.length + torch.tensor(path))
        context = torch.cat([context, tree.tokens[path]])
        nxt = torch.tensor([11 + seed])
        got = prefill(ours, cache, nxt)[0]
        context = torch.cat([context, nxt])
        assert (got - ref(context[None]).logits[0, -1]).abs().max() < TOL


@torch.inference_mode()
def test_a_tree_grown_pass_by_pass_equals_one_pass(tiny_qwen3_5: Path) -> None:
    """A draft grows its tree over several passes, each seeing its ancestors' scratch from earlier passes (its
    root committed part way, as DraftPasses.root does): every node's logits equal the one-pass tree's."""
    ours = load_model(tiny_qwen3_5)
    prompt = torch.randint(7, 300, (12,), generator=torch.Generator().manual_seed(6))
    tree = random_tree(7, ours.args.vocab_size)
    one = ours.new_cache(64)
    prefill(ours, one, prompt[:-2])
    pending = torch.cat([prompt[-2:], tree.tokens[:1]])             # two pending tokens, then the root
    L = one.length
    ours(pending[:2][None], torch.arange(L, L + 2)[None], TreeMask(L, torch.ones(2, 2).bool().tril()), one)
    one.keep(torch.arange(L, L + 2))
    want = tree_pass(ours, one, tree)

    grown = ours.new_cache(64)
    prefill(ours, grown, prompt[:-2])
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    root = ours.logits(ours(pending[None], torch.arange(L, L + 3)[None], TreeMask(L, causal), grown))[-1]
    grown.keep(torch.arange(L, L + 2))                                   # the root stays in scratch
    assert (root - want[0]).abs().max() < TOL
    anc, depths = tree.ancestor_mask(), tree.depths
    for depth in range(1, int(depths.max()) + 1):
        nodes = (depths == depth).nonzero()[:, 0]
        L0 = grown.length
        got = ours.logits(ours(tree.tokens[nodes][None], (L0 + depths[nodes])[None],
                               TreeMask(L0, anc[nodes]), grown, L0 + nodes))
        assert (got - want[nodes]).abs().max() < TOL, f"depth {depth}"


def test_recurrent_store_commits_and_returns() -> None:
    """The ring keeps live rows when it grows; a commit shifts the live rows' decay to the new base; truncate
    returns only to the current length, 0, a point of the latest commit or the snapshot, and reusable says which;
    a causal pass's end state is committed by advance, in order."""
    spec = RecurrentSpec(k_heads=1, v_heads=2, k_dim=2, v_dim=3, conv_dim=8, conv_kernel=3, advance=advance_state)

    def written() -> RecurrentStates:
        store = RecurrentStates(spec, 2, torch.float32, torch.device("cpu"))
        store.reserve(10, 5)
        g = torch.Generator().manual_seed(0)
        G = torch.tensor([[-0.1], [-0.2], [-0.3]]).expand(3, 2)              # g = -0.1 summed along the path
        store.write(1, 5, 3, torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7]), torch.randn(3, 1, 2, generator=g),
                    torch.randn(3, 2, 3, generator=g), torch.full((3, 2), -0.1), G, torch.randn(3, 8, generator=g))
        return store

    store, one = written(), written()
    k = store.k[1, 5 % store.ring].clone()
    store.reserve(5 + 200, 5)                                         # grows past 64: rows stay with their slots
    assert store.ring >= 201 and torch.equal(store.k[1, 5 % store.ring], k)
    store.keep(torch.tensor([5, 6]), 5)
    assert store.state[1].abs().sum() > 0 and store.state[0].abs().sum() == 0
    assert torch.allclose(store.G[1, 7 % store.ring], torch.full((2,), -0.1))   # the next node from the new base
    assert store.reusable(3, 7) == 0 and store.reusable(9, 7) == 7 and store.reusable(6, 7) == 6
    store.truncate(6, 7)                                              # into the latest commit: its first node
    one.keep(torch.tensor([5]), 5)
    assert torch.allclose(store.state, one.state) and torch.equal(store.window, one.window)
    store.snapshot(6)
    store.set_pending(0, 4, torch.ones(2, 2, 3), torch.zeros(8, 2))
    with pytest.raises(ValueError, match="in order"):
        store.keep(torch.tensor([6, 8]), 6)
    store.advance(4, 6)
    assert torch.equal(store.state[0], torch.ones(2, 2, 3))
    assert store.reusable(8, 10) == 6                                 # a prefill keeps no path: its start only
    store.truncate(6, 10)
    assert torch.allclose(store.state, one.state)
    with pytest.raises(ValueError, match="cannot return"):
        store.truncate(4, 6)


# ------------------------------------------------------------------------------------ through the runtime

def hf_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model(path).generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def runtime_ids(target: Path, draft: str | Path | None, offload: str, cache_root: Path, builder: str = "specexec",
                **engine) -> tuple[list[int], list[int], Runtime]:
    rt = Runtime.load(str(target), str(draft) if draft else None,
                      EngineConfig(budget=8, max_new_tokens=N_NEW, builder=builder, **engine),
                      offload=OffloadConfig(offload=offload, quant="none", cache_dir=str(cache_root)))
    ids = rt.encode(PROMPT)
    return ids, [t for step in rt.generate_ids(ids, N_NEW) for t in step], rt


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybrid-layer-cache")


def hybrid_draft(target: Path) -> Path:
    return write_tiny_model(target.parent / f"{target.name}-draft", perturb=DRAFT_PERTURB, base=target, seed=30)


def test_greedy_equals_transformers_generate(tiny_hybrid: Path, cache_root: Path) -> None:
    """--no-draft, a hybrid draft (a perturbed copy: its own tree grown with a state per branch) resident and with
    every target layer on the SSD tier: transformers' ids."""
    ids, want, _ = runtime_ids(tiny_hybrid, None, "none", cache_root)
    assert want == hf_greedy(tiny_hybrid, ids, N_NEW) and len(set(want)) > 4
    for offload in ("none", "ssd"):
        _, got, rt = runtime_ids(tiny_hybrid, hybrid_draft(tiny_hybrid), offload, cache_root)
        assert got == want, f"offload={offload}"
        assert rt.stats()["tokens_per_step"] > 1.3          # the draft's trees were accepted


def test_self_draft_and_dense_draft(tiny_qwen3_5: Path, tiny_llama: Path, cache_root: Path) -> None:
    """`--draft self` of a hybrid target (its own layers, their states per branch) and a dense Llama draft of the
    same tokenizer: the target's own ids."""
    _, want, _ = runtime_ids(tiny_qwen3_5, None, "none", cache_root)
    for offload in ("none", "ssd"):
        _, got, rt = runtime_ids(tiny_qwen3_5, "self", offload, cache_root)
        assert got == want, f"self, offload={offload}"
    _, got, rt = runtime_ids(tiny_qwen3_5, tiny_llama, "none", cache_root)
    assert got == want and rt.engine.draft.args.linear is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_every_builder_is_exact(name: str, tiny_root: Path, cache_root: Path) -> None:
    """Every builder with a hybrid draft, resident and on the SSD tier: the target's greedy ids. The family at 2
    layers, one linear-attention layer and one full (14 runs: what they test, each builder's tree over states per
    branch, does not depend on depth; the 4-layer checkpoints run through the runtime above)."""
    from tests.tiny_models import HYBRID_MODELS
    family, seed = HYBRID_MODELS[name]
    target = write_tiny_model(tiny_root / f"hybrid-{name}-2layers-builders", family, seed=seed, n_layers=2,
                              layer_types=["linear_attention", "full_attention"])
    _, want, _ = runtime_ids(target, None, "none", cache_root)
    assert len(set(want)) > 4                                   # not one token repeated
    for builder in BUILDERS:
        for offload in ("none", "ssd"):
            _, got, _ = runtime_ids(target, hybrid_draft(target), offload, cache_root, builder)
            assert got == want, f"{builder}, offload={offload}"


def test_a_hybrid_draft_is_never_captured_in_a_cuda_graph(tiny_qwen3_5: Path) -> None:
    """Its linear layers find their scratch by slot and read the tree's ancestor mask, which a captured pass
    over a dense span mask would not give them: the draft runs eagerly (graphs exist on CUDA only)."""
    from specexec.builders.draft_graphs import capturable
    from specexec.network.model import one_graph
    model = load_model(tiny_qwen3_5)
    assert not capturable(model) and not one_graph(model.args)


@pytest.mark.parametrize("arch, kind", [("JambaForCausalLM", "Mamba"), ("FalconH1ForCausalLM", "Mamba-2"),
                                        ("NemotronHForCausalLM", "Mamba-2"), ("GraniteMoeHybridForCausalLM", "Mamba-2"),
                                        ("Lfm2ForCausalLM", "short-convolution"),
                                        ("KimiLinearForCausalLM", "Kimi Delta Attention"),
                                        ("Glm5NextForConditionalGeneration", "indexed sparse attention"),
                                        ("Qwen4ExpForCausalLM", "indexed sparse attention")])
def test_other_hybrids_are_refused_naming_the_missing_kind(arch: str, kind: str) -> None:
    from specexec.families.registry import model_args
    from specexec.options import ConfigError
    cfg = {"architectures": [arch], "num_hidden_layers": 4, "hidden_size": 64}
    with pytest.raises(ConfigError) as e:
        model_args(cfg)
    line = str(e.value)
    assert "\n" not in line and kind in line and "layer kind specexec does not run" in line and arch in line


def test_an_unknown_layer_type_is_named() -> None:
    """A Qwen3.5 config whose layer_types name a kind beyond attention and Gated DeltaNet: one line naming it."""
    from specexec.families.registry import model_args
    from specexec.options import ConfigError
    cfg = {"architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
           "layer_types": ["linear_attention", "indexed_attention"]}
    with pytest.raises(ConfigError, match="indexed attention layers are a layer kind"):
        model_args(cfg)


@pytest.mark.slow
@torch.inference_mode()
def test_a_32k_prompt_prefilled_in_chunks_equals_one_pass(tiny_root: Path) -> None:
    """32,768 prompt tokens through a tiny hybrid, prefilled in chunks of 4,096 (the state carried between them)
    and in one pass: the same committed states (to rounding) and the same greedy ids."""
    from specexec.decoding.engine import Engine
    path = tiny_root / "hybrid-qwen3_5-long"
    if not (path / "config.json").exists():
        write_tiny_model(path, "qwen3_5", seed=44, n_layers=4, max_position_embeddings=40000)
    model = load_model(path)
    prompt = torch.randint(7, 300, (32768,), generator=torch.Generator().manual_seed(8)).tolist()
    runs = {}
    for chunk in (4096, 40000):
        engine = Engine(model, None, EngineConfig(max_new_tokens=8, prefill_chunk=chunk), None)
        ids = [t for step in engine.generate(prompt, 8) for t in step]
        store, _ = engine._caches[0].state(0)
        runs[chunk] = ids, store.state.clone()
    (chunked, s1), (whole, s2) = runs[4096], runs[40000]
    assert chunked == whole and len(set(whole)) > 2
    assert torch.allclose(s1, s2, rtol=1e-4, atol=1e-5)
