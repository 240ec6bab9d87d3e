"""CPU decoder layers as one compiled call each (specexec/runtime/cpu_blocks.py over block.c): which layers
qualify, which passes the fast path serves and which it leaves to the modules, that it agrees with the modules up
to fp32 rounding (int4 and int8, biases, per-head q/k norms, fused projections, partial rotary), that it is
row-exact on its own (a token's row in a tree pass has the bits of its one-token pass), that a re-bound module
computes with its new weights, and that a draft and every tier of an offloaded target take it.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cpu_kernels.block import BlockKernel, BlockStack
from cpu_kernels.build import library, status
from offload.quant.linear import QuantLinear
from specexec.checkpoints.loading import load_model, read_args
from specexec.config import EngineConfig, OffloadConfig
from specexec.network.attention import ROW_EXACT_T, TreeMask
from specexec.network.model import Execution
from specexec.runtime.assembly import Runtime
from specexec.runtime.cpu_blocks import fuse_cpu_blocks
from specexec.runtime.offloaded import quantize_layers
from tests.runtime.offloaded_models import offloaded, reference
from tests.tiny_models import family_model, prompt, write_tiny_model

pytestmark = pytest.mark.skipif(library() is None, reason=status())


def _draft(path, fmt: str = "int4", fuse: bool = True):
    model = load_model(path)
    quantize_layers(model, fmt, row_exact=False)
    if fuse:
        assert fuse_cpu_blocks(model) == model.args.n_layers
    return model


def _count(monkeypatch) -> list[int]:
    """calls[0]: how many layer passes the compiled kernels have run since (one layer at a time or in a stack);
    calls[1]: how many whole-stack calls."""
    calls, run, run_stack = [0, 0], BlockKernel.__call__, BlockStack.__call__

    def counted(self, *a):
        calls[0] += 1
        return run(self, *a)

    def counted_stack(self, *a):
        calls[0] += len(self.kernels)
        calls[1] += 1
        return run_stack(self, *a)
    monkeypatch.setattr(BlockKernel, "__call__", counted)
    monkeypatch.setattr(BlockStack, "__call__", counted_stack)
    return calls


def _passes(model, ids: list[int], tree: torch.Tensor, tokens: list[int], depths: list[int]) -> list[torch.Tensor]:
    """Hidden rows of a prefill of ids, then one pass of `tokens` under `tree` ([T, T]) at depth offsets."""
    cache = model.new_cache(64)
    P = len(ids)
    with torch.inference_mode():
        first = model(torch.tensor([ids]), torch.arange(P)[None], TreeMask(0), cache)
        cache.keep(torch.arange(P))
        pos = torch.tensor([[P + d for d in depths]])
        return [first, model(torch.tensor([tokens]), pos, TreeMask(P, tree), cache)]


TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)


@pytest.fixture
def family_path(request, tiny_root, tiny_qwen2, tiny_qwen3):
    return {"qwen2": tiny_qwen2, "qwen3": tiny_qwen3}.get(request.param) or family_model(tiny_root, request.param)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("family_path", ["qwen2", "qwen3", "phi3"], indirect=True)
def test_the_compiled_layers_agree_with_the_modules(family_path, fmt: str, monkeypatch) -> None:
    """qwen2: q/k/v biases; qwen3: per-head q/k RMSNorm; phi3: fused qkv and gate_up, 12 of 16 dims rotary. The
    prefill (14 tokens) and a 4-node tree pass, every layer through the kernel, against the modules."""
    fused, plain = _draft(family_path, fmt), _draft(family_path, fmt, fuse=False)
    plain.run_as(Execution(row_exact=True))            # the same attention kernel on both sides
    calls = _count(monkeypatch)
    args = (prompt(3), TREE, [5, 9, 11, 13], [0, 1, 1, 2])
    for a, b in zip(_passes(fused, *args), _passes(plain, *args)):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 2e-4 * scale, (a - b).abs().max().item() / scale
    assert calls[0] == 2 * fused.args.n_layers


def test_an_mlp_width_off_the_vector_width_agrees(tiny_root, monkeypatch) -> None:
    """An int8 MLP of 100 (not a multiple of 8): the SiLU's scalar tail runs the vector lanes' operations."""
    path = tiny_root / "qwen2-mlp100"
    if not (path / "config.json").exists():
        write_tiny_model(path, "qwen2", seed=41, intermediate_size=100, use_sliding_window=False)
    fused, plain = _draft(path, "int8"), _draft(path, "int8", fuse=False)
    plain.run_as(Execution(row_exact=True))
    calls = _count(monkeypatch)
    args = (prompt(3), TREE, [5, 9, 11, 13], [0, 1, 1, 2])
    for a, b in zip(_passes(fused, *args), _passes(plain, *args)):
        assert (a - b).abs().max().item() <= 2e-4 * b.abs().max().item()
    assert calls[0] == 2 * fused.args.n_layers


def test_a_tree_row_has_the_bits_of_its_one_token_pass(tiny_qwen2) -> None:
    """Row-exact: node 3 (root -> 1 -> 3) in the tree pass equals decoding root, 1, 3 one token at a time."""
    model = _draft(tiny_qwen2)
    ids = prompt(4)
    tree_rows = _passes(model, ids, TREE, [5, 9, 11, 13], [0, 1, 1, 2])[1][0]
    singles = []
    cache = model.new_cache(64)
    with torch.inference_mode():
        model(torch.tensor([ids]), torch.arange(len(ids))[None], TreeMask(0), cache)
        cache.keep(torch.arange(len(ids)))
        for tok in (5, 9, 13):
            L = cache.length
            singles.append(model(torch.tensor([[tok]]), torch.tensor([[L]]), TreeMask(L), cache)[0, 0])
            cache.keep(torch.tensor([L]))
    assert torch.equal(tree_rows[0], singles[0]) and torch.equal(tree_rows[1], singles[1])
    assert torch.equal(tree_rows[3], singles[2])


def test_a_slots_buffer_written_in_place_between_passes_is_read_afresh(tiny_qwen2) -> None:
    """The arguments one forward's layers share are made once per forward: a caller reusing one slots tensor
    (a static buffer) gets the slots it wrote for each pass."""
    model = _draft(tiny_qwen2)
    ids = prompt(9)

    def decode(reuse: bool) -> list[torch.Tensor]:
        cache, outs = model.new_cache(64), []
        with torch.inference_mode():
            buf = torch.zeros(1, dtype=torch.long)
            model(torch.tensor([ids]), torch.arange(len(ids))[None], TreeMask(0), cache)
            cache.keep(torch.arange(len(ids)))
            for tok in (5, 9, 13):
                L = cache.length
                slots = buf.fill_(L) if reuse else torch.tensor([L])
                outs.append(model(torch.tensor([[tok]]), torch.tensor([[L]]), TreeMask(L), cache, slots))
                cache.keep(torch.tensor([L]))
        return outs

    assert all(torch.equal(a, b) for a, b in zip(decode(True), decode(False)))


def test_a_resident_model_runs_its_whole_stack_in_one_call_with_the_layers_bits(tiny_qwen2, monkeypatch) -> None:
    """Every layer compiled: a prefill and a tree pass are one stack call each, with the bits of the same layers
    called one by one; a model whose layers changed after fusing (a layer lost its fast path) runs layer by
    layer again."""
    model = _draft(tiny_qwen2)
    args = (prompt(3), TREE, [5, 9, 11, 13], [0, 1, 1, 2])
    calls = _count(monkeypatch)
    stacked = _passes(model, *args)
    assert calls == [2 * model.args.n_layers, 2]
    told = model.execution
    model.run_as(replace(told, stack=None))
    by_layer = _passes(model, *args)
    assert calls == [4 * model.args.n_layers, 2]
    assert all(torch.equal(a, b) for a, b in zip(stacked, by_layer))
    model.run_as(told)
    model.layers[1].run_as(None, True)
    _passes(model, *args)
    assert calls == [4 * model.args.n_layers + 2, 2]


def test_passes_the_kernel_cannot_serve_run_the_modules(tiny_qwen2, monkeypatch) -> None:
    """int8 KV rows, a pass of more than ROW_EXACT_T tokens (no slot lists): the modules run (the kernel is not
    called) and give the bits of the separate q/k/v and gate/up the fused model joined (each output row is
    computed on its own)."""
    model, plain = _draft(tiny_qwen2), _draft(tiny_qwen2, fuse=False)
    plain.run_as(Execution(row_exact=True))
    assert hasattr(model.layers[0].self_attn, "qkv_proj") and hasattr(model.layers[0].mlp, "gate_up_proj")
    assert hasattr(plain.layers[0].self_attn, "q_proj") and hasattr(plain.layers[0].mlp, "gate_proj")
    calls = _count(monkeypatch)
    ids = prompt(5)
    with torch.inference_mode():
        a, b = (m(torch.tensor([ids]), torch.arange(len(ids))[None], TreeMask(0), m.new_cache(64, quant="int8"))
                for m in (model, plain))
        assert calls[0] == 0 and torch.equal(a, b)
        long = torch.randint(7, 300, (1, ROW_EXACT_T + 1))
        model(long, torch.arange(ROW_EXACT_T + 1)[None], TreeMask(0), model.new_cache(ROW_EXACT_T + 8))
        assert calls[0] == 0


def test_a_re_bound_layer_runs_its_new_weights(tiny_qwen2, monkeypatch) -> None:
    """A module re-pointed at other tensors (what a streamed layer's slot is on every pass) gets its kernel
    rebuilt: layer 0 given layer 1's o_proj and input norm computes with them, not with stale pointers."""
    model, plain = _draft(tiny_qwen2), _draft(tiny_qwen2, fuse=False)
    plain.run_as(Execution(row_exact=True))
    ids = prompt(7)
    run = lambda m: m(torch.tensor([ids]), torch.arange(len(ids))[None], TreeMask(0), m.new_cache(64))  # noqa: E731
    with torch.inference_mode():
        before = run(model)
        for m in (model, plain):
            src, dst = m.layers[1], m.layers[0]
            o = src.self_attn.o_proj
            dst.self_attn.o_proj.set_parts({s: t.clone() for s, t in o.parts().items()}, o.wmeta, None)
            dst.input_layernorm.weight = torch.nn.Parameter(src.input_layernorm.weight.detach().clone())
        calls = _count(monkeypatch)
        a, b = run(model), run(plain)
    assert calls[0] == model.args.n_layers
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= 2e-4 * scale < (a - before).abs().max().item()


def test_layers_the_kernel_does_not_cover_are_left_alone(tiny_root, tiny_qwen3_moe, tiny_llama) -> None:
    """Gemma 2 (sandwich norms, soft-capping, GeLU), an MoE's sparse layers (its dense layer 1 qualifies) and an
    unquantized model keep their modules."""
    assert fuse_cpu_blocks(_draft(family_model(tiny_root, "gemma2"), fuse=False)) == 0
    moe = _draft(tiny_qwen3_moe, fuse=False)
    assert fuse_cpu_blocks(moe) == 1 and [b.fast is not None for b in moe.layers] == [False, True, False]
    plain = load_model(tiny_llama)
    assert fuse_cpu_blocks(plain) == 0 and not plain.execution.row_exact
    assert all(block.fast is None for block in plain.layers)


def test_an_int4_draft_on_a_cpu_runs_compiled_and_stays_exact(tiny_pair, tiny_perturbed_draft, monkeypatch) -> None:
    """Loaded through the runtime, an int4 draft's layers have the fast path; greedy output is the target's."""
    config = EngineConfig(budget=8)
    alone = Runtime.load(str(tiny_pair[0]), None, config)
    rt = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config, offload=OffloadConfig(draft_quant="int4"))
    draft = rt.engine.draft
    assert all(b.fast is not None for b in draft.layers)
    assert all(isinstance(m, QuantLinear) for m in draft.layers[0].mlp.children())
    calls = _count(monkeypatch)
    ids = prompt(6)
    flat = lambda r: [t for step in r.generate_ids(ids, 24) for t in step]          # noqa: E731
    assert flat(rt) == flat(alone)
    assert calls[0] > 0 and rt.stats()["tokens_per_step"] > 1


def test_an_offloaded_int4_target_runs_compiled_on_every_tier(tiny_pair, tmp_path, monkeypatch) -> None:
    """Resident, RAM and SSD layers (the slots re-bound on every pass) all take the compiled path, twice over, with
    the bits of the resident reference (which takes it too)."""
    model = offloaded(tiny_pair[0], "int4", ["ram", "ssd", "resident", "ram"], tmp_path)
    want = _passes(reference(tiny_pair[0], "int4"), prompt(8), TREE, [5, 9, 11, 13], [0, 1, 1, 2])
    calls = _count(monkeypatch)
    try:
        for n in (1, 2):
            got = _passes(model, prompt(8), TREE, [5, 9, 11, 13], [0, 1, 1, 2])
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            assert calls == [2 * n * model.args.n_layers, 0]            # layer by layer: some stream
    finally:
        model.close()


def test_an_all_resident_offloaded_target_runs_its_stack_in_one_call(tiny_pair, tmp_path, monkeypatch) -> None:
    """Every layer resident (nothing for the pager to stream between layers): one stack call a pass, with the
    bits of the resident reference; a plan that streams a layer keeps going layer by layer (the test above)."""
    n = read_args(tiny_pair[0]).n_layers
    model = offloaded(tiny_pair[0], "int4", ["resident"] * n, tmp_path)
    want = _passes(reference(tiny_pair[0], "int4"), prompt(8), TREE, [5, 9, 11, 13], [0, 1, 1, 2])
    calls = _count(monkeypatch)
    try:
        got = _passes(model, prompt(8), TREE, [5, 9, 11, 13], [0, 1, 1, 2])
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert calls == [2 * n, 2] and model.execution.stack is not None
    finally:
        model.close()
