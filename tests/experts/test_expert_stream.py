"""A streamed MoE layer in two phases (specexec/runtime/expert_stream.py, offload/streaming/parts.py): the dense
part ahead, then only the experts the pass's rows were routed to, some served by the device expert cache.
Exact against the resident model (fp32, bit for bit) on every tier; counted in bytes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli.main import main
from specexec.checkpoints.loading import load_model
from specexec.network.model import TreeMask
from specexec.tree import TokenTree
from tests.network.model_reference import new_cache, prefill
from tests.runtime.offloaded_models import offloaded
from tests.tiny_models import DRAFT_PERTURB, write_tiny_model

TIERS = {"ssd": ["ssd"] * 3, "ram": ["ram"] * 3, "mixed": ["ram", "resident", "ssd"]}   # layer 1 is dense


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("expert-stream")


def tree_logits(model, ids: torch.Tensor, tree: TokenTree) -> torch.Tensor:
    """Logits of every node of `tree` after a prefill of `ids` (a fresh KV cache each call)."""
    cache = new_cache(model)
    prefill(model, cache, ids)
    L = cache.length
    return model.logits(model(tree.tokens[None], tree.positions(L)[None], TreeMask(L, tree.ancestor_mask()), cache))


@pytest.mark.parametrize("tiers", list(TIERS))
@pytest.mark.parametrize("cache", [0, 3])
def test_a_tree_pass_equals_the_resident_model_bit_for_bit(tiny_qwen3_moe: Path, root: Path, tiers: str,
                                                            cache: int) -> None:
    ref = load_model(tiny_qwen3_moe)
    model = offloaded(tiny_qwen3_moe, "none", TIERS[tiers], root, expert_cache=cache)   # (outside inference mode,
    g = torch.Generator().manual_seed(4)                                # as the runtime builds it)
    ids = torch.randint(7, 300, (9,), generator=g)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6]
    for step in range(3):                                               # the cache fills, then serves
        tree = TokenTree.from_lists(torch.randint(7, 300, (10,), generator=g).tolist(), parents)
        with torch.inference_mode():
            got, want = tree_logits(model, ids, tree), tree_logits(ref, ids, tree)
        assert torch.equal(got, want), f"pass {step}"
    c = model.expert_counters()
    assert c["expert_lookups"] > 0 and c["expert_bytes"] > 0
    assert (c["expert_hits"] > 0) == (cache > 0)
    model.close()


def test_only_the_routed_experts_move(tiny_qwen3_moe: Path, root: Path) -> None:
    """One row reads its top-4 of 16 experts per sparse layer: a quarter of their bytes, and the pager's streamed
    bytes are the dense parts plus exactly those experts."""
    model = offloaded(tiny_qwen3_moe, "none", TIERS["ssd"], root)
    lay = model.layouts[0]
    expert = lay.regions[0].nbytes
    before = model.pager.counters()["bytes_streamed"]
    with torch.inference_mode():
        model(torch.tensor([[42]]), torch.tensor([[0]]), None)
    moved = model.expert_counters()["expert_bytes"]
    assert moved == 2 * 4 * expert                                      # two sparse layers, top-4 each
    dense = sum(model.layouts[i].dense_nbytes for i in (0, 2)) + model.layouts[1].nbytes
    assert model.pager.counters()["bytes_streamed"] - before == dense + moved
    model.close()


def test_a_cache_of_every_expert_moves_none_once_warm(tiny_qwen3_moe: Path, root: Path) -> None:
    model = offloaded(tiny_qwen3_moe, "none", TIERS["ram"], root, expert_cache=16)
    with torch.inference_mode():
        for t in range(40):                                             # every expert gets routed to, and kept
            model(torch.tensor([[7 + 7 * t, 8 + 5 * t, 9 + 3 * t]]), torch.arange(3)[None], None)
        held = model.experts_held()
        c0 = model.expert_counters()
        model(torch.tensor([[11, 12]]), torch.arange(2)[None], None)
    c1 = model.expert_counters()
    assert held.shape == (2, 16) and bool(held.all())
    assert c1["expert_bytes"] == c0["expert_bytes"] and c1["expert_hits"] - c0["expert_hits"] == \
        c1["expert_lookups"] - c0["expert_lookups"] > 0
    model.close()


def generate_json(capsys, *argv: str) -> dict:
    assert main(["generate", *argv, "--json", "--max-new-tokens", "12", "--quant", "none",
                 "--prompt", "The quick brown fox"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_stats_moe_one_token_reads_a_quarter_a_tree_more_but_not_all(tiny_qwen3_moe: Path, tiny_root: Path,
                                                                     root: Path, capsys) -> None:
    """`generate --json` of a tiny Qwen3-MoE (16 experts, top-4) streamed from the SSD tier: a one-token pass
    (--no-draft) reads <= 30 % of the experts' bytes; a budget-16 tree (--expert-trim off: the whole tree) reads
    more, not all; the same ids either way."""
    draft = write_tiny_model(tiny_root / "qwen3-moe-stream-draft", perturb=DRAFT_PERTURB, base=tiny_qwen3_moe,
                             seed=32)
    common = ["--model", str(tiny_qwen3_moe), "--offload", "ssd", "--cache-dir", str(root)]
    alone = generate_json(capsys, *common, "--no-draft")
    tree = generate_json(capsys, *common, "--draft", str(draft), "--budget", "16", "--expert-trim", "off")
    one, big = alone["stats"]["moe"], tree["stats"]["moe"]
    assert one["expert_bytes_all"] == big["expert_bytes_all"] > 0
    assert one["expert_bytes_per_pass"] <= 0.30 * one["expert_bytes_all"]
    assert one["expert_bytes_per_pass"] < big["expert_bytes_per_pass"] < big["expert_bytes_all"]
    assert one["distinct_experts_per_layer"] == 4 < big["distinct_experts_per_layer"] < 16
    assert alone["token_ids"] == tree["token_ids"]
