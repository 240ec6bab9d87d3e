"""Hybrid targets (Qwen3.5 dense, Qwen3.5-MoE, Qwen3-Next) through the whole runtime at trees of more than 64
nodes (issue 55 §1): greedy ids equal transformers' `generate` for every builder, resident and with every target
layer on the SSD tier, with a hybrid draft (a perturbed copy: its own tree grown over states per branch) and
with `--draft self`. Each run checks that some verified tree was larger than the recurrent store's first ring
(64 rows) and that a target pass followed it (the state it committed was read again).

The models are the families at 2 layers (one Gated DeltaNet layer, one full attention: tests/tiny_models.
hybrid_model_2layers). All of it is `slow` (a run is seconds): every (family, builder) at budget 64 (a 65-node
pass) and 256 (the chain at 64, recycling at 256); a 1,024-node tree (the largest --budget auto tries) for each
builder but the chain on one family in turn; `--draft self` at 256 and 1,024. The quick loop's check of every
tree size, per family, is a single tree pass against transformers (tests/network/test_hybrid_trees.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specexec.config import EngineConfig, OffloadConfig
from specexec.runtime.assembly import Runtime
from tests.network.model_reference import hf_model
from tests.tiny_models import DRAFT_PERTURB, hybrid_model_2layers, write_tiny_model

PROMPT = "The quick brown fox"
N_MAX = 64            # tokens at most; a run stops at the step after its first tree of more than RING nodes
FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")
BUILDERS = ("specexec", "chain", "static", "dynamic", "optree", "rsd", "recycling")
RING = 64             # specexec/kv/recurrent.MIN_RING: the store's first ring


class Pairs:
    """Per family, written and computed once for the module: the 2-layer target, its perturbed draft and
    transformers' greedy ids."""

    def __init__(self, root: Path) -> None:
        self.root, self.want = root, {}

    def target(self, name: str) -> Path:
        return hybrid_model_2layers(self.root, name)

    def draft(self, name: str) -> Path:
        target = self.target(name)
        path = target.parent / f"{target.name}-draft"
        return path if (path / "config.json").exists() else write_tiny_model(path, perturb=DRAFT_PERTURB,
                                                                               base=target, seed=30)

    def greedy(self, name: str, ids: list[int], n: int) -> list[int]:
        if name not in self.want:
            with torch.inference_mode():
                out = hf_model(self.target(name)).generate(torch.tensor([ids]), max_new_tokens=N_MAX,
                                                           do_sample=False)
            self.want[name] = out[0, len(ids):].tolist()
        return self.want[name][:n]


@pytest.fixture(scope="module")
def pairs(tiny_root: Path) -> Pairs:
    return Pairs(tiny_root)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hybrid-budgets-layer-cache")


def check(pairs: Pairs, cache_root: Path, name: str, budget: int, builder: str = "specexec",
          draft: str = "hybrid", offloads: tuple[str, ...] = ("none", "ssd")) -> None:
    """For each offload: the runtime's greedy ids at `budget`, up to the step after its first verified tree of
    more than RING nodes (that step's pass reads the state the big tree's commit left), equal transformers'."""
    for offload in offloads:
        rt = Runtime.load(str(pairs.target(name)), str(pairs.draft(name)) if draft == "hybrid" else draft,
                          EngineConfig(budget=budget, max_new_tokens=N_MAX, builder=builder),
                          offload=OffloadConfig(offload=offload, quant="none", cache_dir=str(cache_root)))
        ids, got, sizes = rt.encode(PROMPT), [], []
        for step in rt.generate_ids(ids, N_MAX):
            got += step
            sizes = [s.tree_size + 1 for s in rt.engine.stats.steps]       # nodes verified, root included
            if max(sizes[:-1], default=0) > RING:
                break
        where = f"{name}, {builder}, budget {budget}, draft {draft}, offload {offload}: trees of {sizes} nodes"
        assert max(sizes[:-1], default=0) > RING, where
        assert got == pairs.greedy(name, ids, len(got)), where


@pytest.mark.slow
@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_and_builder_past_the_ring(name: str, builder: str, pairs: Pairs, cache_root: Path) -> None:
    """Budget 64 (a 65-node pass) and 256; recycling's budget-64 template rarely fills (it learns the target's
    top-k as it goes), so it runs 256 only; the chain (one draft pass per node) 64 only."""
    for budget in {"recycling": (256,), "chain": (64,)}.get(builder, (64, 256)):
        check(pairs, cache_root, name, budget, builder)


@pytest.mark.slow
@pytest.mark.parametrize("builder", [b for b in BUILDERS if b != "chain"])
def test_the_largest_auto_tree(builder: str, pairs: Pairs, cache_root: Path) -> None:
    """1,024 nodes (AUTO_MAX_BUDGET), each builder on one family in turn, resident and SSD (not the chain: 1,024
    draft passes a step, ~3 minutes here; its 65-node trees run above)."""
    check(pairs, cache_root, FAMILIES[BUILDERS.index(builder) % len(FAMILIES)], 1024, builder)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_a_self_draft_past_the_ring(name: str, pairs: Pairs, cache_root: Path) -> None:
    """`--draft self`: the target's own layers draft, their states per branch in the draft's store."""
    check(pairs, cache_root, name, 256, draft="self")
    check(pairs, cache_root, name, 1024, draft="self", offloads=("none",))
