"""Experts computed on the CPU from the RAM tier's bytes (specexec/runtime/cpu_experts.py, --experts cpu): the
same bits as the streamed and the resident model (fp32, int4), no expert byte copied, and on CUDA only the hidden
states and routing cross the link."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specexec.builders.specexec import SpecExecBuilder
from specexec.checkpoints.loading import load_model, read_args
from specexec.config import EngineConfig
from specexec.decoding.engine import Engine
from specexec.network.model import TreeMask
from specexec.runtime.cpu_experts import crossed_bytes
from specexec.runtime.offloaded import build_offloaded, quantize_head
from specexec.tree import TokenTree
from tests.network.model_reference import new_cache, prefill
from tests.runtime.offloaded_models import offloaded, open_cache, reference
from tests.tiny_models import DRAFT_PERTURB, write_tiny_model

RAM = ["ram"] * 3                        # tiny Qwen3-MoE: layers 0 and 2 sparse, 1 dense
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6]


def tree_logits(model, ids: torch.Tensor, tree: TokenTree) -> torch.Tensor:
    cache = new_cache(model)
    prefill(model, cache, ids)
    L = cache.length
    return model.logits(model(tree.tokens[None], tree.positions(L)[None], TreeMask(L, tree.ancestor_mask()), cache))


def with_cpu(path: Path, fmt: str, root: Path, layers=(0, 2), device: str = "cpu", dtype=torch.float32):
    return build_offloaded(path, read_args(path), open_cache(path, fmt, root), RAM, torch.device(device), dtype,
                           cpu_layers=layers)


@pytest.mark.parametrize("fmt", ["none", "int4"])
@pytest.mark.parametrize("layers", [(0, 2), (2,)])
def test_cpu_experts_equal_streamed_and_resident_bit_for_bit(tiny_qwen3_moe: Path, tmp_path: Path, fmt: str,
                                                             layers: tuple[int, ...]) -> None:
    ref, streamed = reference(tiny_qwen3_moe, fmt), offloaded(tiny_qwen3_moe, fmt, RAM, tmp_path)
    model = with_cpu(tiny_qwen3_moe, fmt, tmp_path, layers)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(7, 300, (9,), generator=g)
    for _ in range(2):
        tree = TokenTree.from_lists(torch.randint(7, 300, (10,), generator=g).tolist(), PARENTS)
        with torch.inference_mode():
            got, want = tree_logits(model, ids, tree), tree_logits(streamed, ids, tree)
            alone = tree_logits(ref, ids, tree)
        assert torch.equal(got, want) and torch.equal(got, alone)
    c = model.expert_counters()
    streamed_layers = 2 - len(layers)
    assert (c["expert_bytes"] > 0) == (streamed_layers > 0)
    assert c["cpu_expert_bytes_crossed"] == 0                  # the device is the CPU: nothing crosses
    assert c["cpu_expert_rows"] > 0 and bool(model.experts_held().all()) == (streamed_layers == 0)
    model.close(), streamed.close()


@pytest.mark.parametrize("cpu", [(), (0, 2)])
def test_int4_rows_are_batch_invariant(tiny_qwen3_moe: Path, tmp_path: Path, cpu: tuple[int, ...]) -> None:
    """A tree's root row gets, bit for bit, the logits of a one-token pass of the root, whatever the tree's size:
    the int4 kernel is row-exact, the CPU experts run it on each expert's gathered rows, and the router scores
    row by row (a batched fp32 GEMM would round a row's scores by the batch's size)."""
    model = with_cpu(tiny_qwen3_moe, "int4", tmp_path, cpu) if cpu else offloaded(tiny_qwen3_moe, "int4", RAM,
                                                                                     tmp_path)
    quantize_head(model, "int4")                                # as load_target does: the int8 head kernel
    ids = torch.randint(7, 300, (8,), generator=torch.Generator().manual_seed(3))
    tokens = torch.randint(7, 300, (17,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.inference_mode():
        one = tree_logits(model, ids, TokenTree.from_lists(tokens[:1], [-1]))[0, 0]
        for n in (2, 5, 9, 17):
            tree = TokenTree.from_lists(tokens[:n], [-1] + [i // 2 for i in range(n - 1)])
            assert torch.equal(tree_logits(model, ids, tree)[0, 0], one), n
    model.close()


@pytest.mark.parametrize("budget", [4, 16])
def test_speculative_greedy_equals_the_int4_target_alone(tiny_qwen3_moe: Path, tiny_root: Path, tmp_path: Path,
                                                         budget: int) -> None:
    """Batch invariance: with int4 experts on the CPU (the row-exact integer kernel) and the router scoring row
    by row, every tree node gets its one-token bits, so speculative greedy ids equal the target alone."""
    model = with_cpu(tiny_qwen3_moe, "int4", tmp_path)
    quantize_head(model, "int4")                                # as load_target does: the int8 head kernel
    draft = load_model(write_tiny_model(tiny_root / "qwen3-moe-cpu-draft", perturb=DRAFT_PERTURB,
                                        base=tiny_qwen3_moe, seed=33))
    prompt = torch.randint(7, 300, (12,), generator=torch.Generator().manual_seed(budget)).tolist()
    alone = [t for s in Engine(model, None, EngineConfig(budget=1), None).generate(prompt, 24) for t in s]
    engine = Engine(model, draft, EngineConfig(budget=budget, expert_trim="off"), SpecExecBuilder())
    assert [t for s in engine.generate(prompt, 24) for t in s] == alone
    assert max(s.tree_size for s in engine.stats.steps) > 1
    model.close()


def test_only_the_dense_parts_stream(tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    model = with_cpu(tiny_qwen3_moe, "none", tmp_path)
    before = model.pager.counters()["bytes_streamed"]
    with torch.inference_mode():
        model(torch.tensor([[42, 43, 44]]), torch.arange(3)[None], None)
    dense = sum(model.layouts[i].dense_nbytes for i in (0, 2)) + model.layouts[1].nbytes
    assert model.pager.counters()["bytes_streamed"] - before == dense
    c = model.expert_counters()
    assert c["expert_bytes"] == 0 and c["cpu_expert_rows"] == 2 * 3 and c["cpu_expert_layers"] == 2
    model.close()


def test_a_layer_not_in_ram_is_refused(tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="held in RAM"):
        build_offloaded(tiny_qwen3_moe, read_args(tiny_qwen3_moe), open_cache(tiny_qwen3_moe, "none", tmp_path),
                        ["ssd", "ram", "ram"], torch.device("cpu"), torch.float32, cpu_layers=(0,))


@pytest.mark.gpu
def test_on_cuda_only_hidden_states_cross(tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    """Attention and router on the GPU, experts on the CPU: per pass each CPU layer moves its T rows' hidden
    states there and back (plus the routing), no expert byte; the result matches the streamed model's."""
    args = read_args(tiny_qwen3_moe)
    model = with_cpu(tiny_qwen3_moe, "none", tmp_path, device="cuda")
    streamed = build_offloaded(tiny_qwen3_moe, args, open_cache(tiny_qwen3_moe, "none", tmp_path), RAM,
                               torch.device("cuda"), torch.float32)
    tokens = torch.tensor([[42, 43, 44, 45, 46]], device="cuda")
    pos = torch.arange(5, device="cuda")[None]
    with torch.inference_mode():
        got, want = model(tokens, pos, None), streamed(tokens, pos, None)
    c, s = model.expert_counters(), streamed.expert_counters()
    per_layer = crossed_bytes(5, args.dim, args.moe.top_k, torch.float32)
    assert c["cpu_expert_bytes_crossed"] == 2 * per_layer and c["expert_bytes"] == 0
    assert c["cpu_expert_bytes_crossed"] < 0.1 * s["expert_bytes"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    model.close(), streamed.close()


def test_generate_experts_cpu_equals_streamed_and_counts_rows(tiny_qwen3_moe: Path, tmp_path: Path, capsys) -> None:
    """`generate --offload ram --experts cpu` vs `--experts stream` vs the resident target: the same fp32 greedy
    ids; stats.moe says the CPU ran each pass's rows of both sparse layers and no expert byte was copied."""
    import json

    from cli.main import main

    def run(*extra: str) -> dict:
        assert main(["generate", "--model", str(tiny_qwen3_moe), "--no-draft", "--json", "--max-new-tokens", "10",
                     "--quant", "none", "--cache-dir", str(tmp_path), "--prompt", "The quick brown fox", *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    cpu, streamed = run("--offload", "ram", "--experts", "cpu"), run("--offload", "ram", "--experts", "stream")
    alone = run("--offload", "none")
    assert cpu["token_ids"] == streamed["token_ids"] == alone["token_ids"]
    moe = cpu["stats"]["moe"]
    assert moe["expert_bytes_per_pass"] == 0 and moe["cpu_expert_rows_per_pass"] == 2.0
    assert moe["cpu_expert_bytes_crossed_per_pass"] == 0          # the device is the CPU
    assert streamed["stats"]["moe"]["expert_bytes_per_pass"] > 0
    assert streamed["stats"]["moe"]["cpu_expert_rows_per_pass"] == 0
