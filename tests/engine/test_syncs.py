"""Host syncs counted on the CPU (tests/sync_count.py): at most ONE per draft pass for every builder that grows
its tree with the draft through the shared growth core, none inside a target layer's forward, none in the
tree's ancestor mask; and the counter itself catches every kind of sync it claims to.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specexec.builders.growth import padded
from specexec.config import EngineConfig, SamplingParams
from specexec.decoding.engine import Engine
from specexec.kv.cache import KVCache
from specexec.network.attention import TreeMask
from specexec.builders.registry import make_builder
from specexec.acceptance.rules import default_rule
from specexec.tree import TokenTree, best_nodes
from specexec.uploads import upload
from tests.sync_count import SyncCounter, count_calls
from tests.tiny_models import load_pair_models, prompt

GROWING = ["specexec", "chain", "dynamic", "optree", "rsd", "rsd-c", "static"]


@pytest.fixture(scope="module")
def models(tiny_pair: tuple[Path, Path], tiny_perturbed_draft: Path):
    return load_pair_models(tiny_pair, tiny_perturbed_draft)


class Counted:
    """Wraps a builder: per build, the host syncs and uploads made inside it and the draft passes it ran."""

    def __init__(self, builder, draft_model: torch.nn.Module) -> None:
        self.inner, self.model, self.builds = builder, draft_model, []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def build(self, draft, root_token, budget, sampling, rng=None) -> TokenTree:
        with count_calls(self.model) as calls, SyncCounter() as syncs:
            tree = self.inner.build(draft, root_token, budget, sampling, rng)
        self.builds.append((calls[0], syncs.total, syncs.uploads, dict(syncs.ops)))
        return tree


def run_counted(models, name: str, budget: int, sampling: SamplingParams, builder=None,
                n_new: int = 16) -> list[tuple[int, int, int, dict]]:
    draft = models["perturbed"]
    builder = builder or make_builder(name)
    if hasattr(builder, "shape_for"):            # Sequoia's DP runs once per budget on the host (cached)
        builder.shape_for(budget, sampling.temperature)
    counted = Counted(builder, draft)
    engine = Engine(models["target"], draft, EngineConfig(budget=budget, builder=name), counted)
    for _ in engine.generate(prompt(11), n_new, sampling):
        pass
    return counted.builds


# (builder, budget, temperature, verifier) -> (every build's (passes, syncs, uploads, ops), every step after the
# first: (its build's passes, its build's syncs, the whole step's syncs, the step's ops)); run once per module.
_RUNS: dict[tuple[str, int, float, str], tuple[list[tuple[int, int, int, dict]], list[tuple[int, int, int, dict]]]] = {}


def counted_steps(models, name: str, budget: int, sampling: SamplingParams, verifier: str = "auto"):
    """Generates 16 tokens after prompt(11), counting each build (Counted) and, after the prefill and the first
    step, each whole step the CUDA way (draft, verify, commit, observe, account). "auto" is resolved to the
    builder's own rule first, so the two tests below share a run wherever they ask for the same rule."""
    builder = make_builder(name)
    if verifier == "auto":
        verifier = default_rule(builder.drafting, sampling)
    key = (name, budget, sampling.temperature, verifier)
    if key not in _RUNS:
        if hasattr(builder, "shape_for"):        # Sequoia's DP runs once per budget on the host (cached)
            builder.shape_for(budget, sampling.temperature)
        counted = Counted(builder, models["perturbed"])
        engine = Engine(models["target"], models["perturbed"],
                        EngineConfig(budget=budget, builder=name, verifier=verifier), counted)
        steps, whole = engine.generate(prompt(11), 16, sampling), []
        next(steps)                                                      # the prefill and a first step
        while True:
            n = len(counted.builds)
            with SyncCounter() as c:
                if next(steps, None) is None:
                    break
            passes, syncs = counted.builds[n][:2] if len(counted.builds) > n else (0, 0)
            whole.append((passes, syncs, c.total, dict(c.ops)))
        _RUNS[key] = counted.builds, whole
    return _RUNS[key]


@pytest.mark.slow
@pytest.mark.parametrize("name", GROWING)
def test_at_most_one_host_sync_per_draft_pass(models, name: str) -> None:
    passes_total = 0
    for budget in (2, 40):
        for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=1)):
            builds, _ = counted_steps(models, name, budget, sampling)
            for i, (passes, syncs, uploads, ops) in enumerate(builds):
                assert syncs <= passes, f"{name} budget={budget} T={sampling.temperature}: {syncs} host syncs " \
                                        f"in {passes} draft passes: {ops}"
                assert i == 0 or uploads <= 1, f"{name}: {uploads} tensors made from host data in one build"
                passes_total += passes                  # (the first build may make a shape's cached indices)
    assert passes_total > 10                                  # the builds really ran draft passes


@pytest.mark.slow
@pytest.mark.parametrize("name", GROWING)
def test_a_step_syncs_once_besides_its_draft_passes(models, name: str) -> None:
    """Counted the CUDA way over whole steps (draft, verify, commit, observe, account; after the prefill): the
    builder's passes at most one each, and the rest of the step exactly one (the rule's read of the accepted
    path), greedy and sample-and-match alike."""
    for budget in (2, 40):
        for sampling, verifier in ((SamplingParams(), "auto"),
                                   (SamplingParams(temperature=0.8, top_p=0.9, seed=1), "sample_match")):
            _, whole = counted_steps(models, name, budget, sampling, verifier)
            assert whole                                             # steps after the first were counted
            for passes, syncs, total, ops in whole:
                assert syncs <= passes and total - syncs == 1, (name, budget, sampling.temperature, ops)


def test_specexec_at_its_widest_still_syncs_once_per_pass(models) -> None:
    """The high-ratio policy (paper width: up to 128 beams) on a larger budget, many passes per tree."""
    builds = run_counted(models, "specexec", 200, SamplingParams(), make_builder("specexec",
                                                                                 (("cost_ratio", 100.0),)))
    assert sum(p for p, *_ in builds) > 3 * len(builds)
    assert all(s <= p for p, s, *_ in builds), builds


def test_a_target_layer_forward_makes_no_host_sync(models) -> None:
    """The attention plan and model.Block over a tree input (cache write, split masked attention, MLP): nothing
    the host waits for."""
    target = models["target"]
    a = target.args
    tree = TokenTree.from_lists([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 1, 3])
    cache = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, 64, torch.float32, "cpu")
    cache.advance(20)
    positions = tree.positions(20)
    slots = torch.arange(20, 26)
    x = target.embed_tokens(tree.tokens)[None]
    cos, sin = target.rope(positions[None], x.dtype)
    with torch.inference_mode():
        with SyncCounter() as c:
            plan = target.attention_plan(TreeMask(20, tree.ancestor_mask()), positions[None], x.dtype)
            out = target.layers[0](x, cos, sin, plan, cache, 0, slots)
    assert out.shape == x.shape
    assert c.total == 0 and c.uploads == 0, c.ops


def test_ancestor_mask_and_best_nodes_make_no_host_sync() -> None:
    parents = [-1, 0, 0, 1, 3, 4, 5, 2, 7, 6]
    tree = TokenTree.from_lists(list(range(10)), parents, [0.0, -1, -2, -1.5, -2, -3, -4, -2.5, -3, -5])
    with SyncCounter() as c:
        mask = tree.ancestor_mask()
        keep = best_nodes(tree.scores, 4, n_finite=9)
    assert c.total == 0, c.ops
    assert mask[9].nonzero().flatten().tolist() == [0, 1, 3, 4, 5, 6, 9]
    assert keep.tolist() == [0, 1, 2, 3, 4]


def test_the_counter_catches_every_kind_of_sync() -> None:
    """Negative controls: each pattern the growth core avoids is counted."""
    x = torch.arange(10.0)
    cases = {
        "item": lambda: x[3].item(), "int": lambda: int(x[2]), "bool": lambda: bool((x > 3).any()),
        "if": lambda: 1 if x[1] else 0, "nonzero": lambda: torch.nonzero(x > 4),
        "mask index": lambda: x[x > 4], "mask put": lambda: x.clone().__setitem__(x > 4, 0.0),
        "masked_select": lambda: x.masked_select(x > 4), "tolist": lambda: x.tolist(),
        "unique": lambda: torch.unique(x), "equal": lambda: torch.equal(x, x),
    }
    for what, fn in cases.items():
        with SyncCounter() as c:
            fn()
        assert c.total >= 1, what
    with SyncCounter() as c:
        y = torch.where(x > 4, x, 0.0).topk(3).indices
        x.clone().index_put_((y,), torch.zeros(3))
    assert c.total == 0, c.ops


def test_the_counter_counts_blocking_uploads_the_cuda_way() -> None:
    """What CUDA's sync debug mode reports besides reads: a tensor made from Python data on the device (0-dim
    too), a host tensor moved there without non_blocking, indexing a device tensor with a list or a host tensor;
    and what it does not: Python scalars, device factories, specexec.uploads.upload, the host's own tensors."""
    x = torch.arange(10.0)
    counted = {
        "tensor on the device": lambda: torch.tensor([1, 2], device=x.device),
        "0-dim new_tensor": lambda: x.new_tensor(float("-inf")),
        "blocking move": lambda: torch.tensor([1, 2]).to(x.device),
        "list index": lambda: x[[1, 2]],
        "host index": lambda: x[torch.arange(3)],
        "list index put": lambda: x.clone().__setitem__([1, 2], 0.0),
    }
    for what, fn in counted.items():
        with SyncCounter() as c:
            fn()
        assert c.total == 1, (what, c.ops)
    free = {
        "python scalars": lambda: torch.where(x > 4, x, 0.0).clone().__setitem__(0, 1.0),
        "device factories": lambda: torch.full((), float("-inf"), device=x.device) + torch.arange(3, device=x.device),
        "upload": lambda: x[upload([1, 2], x.device)],
        "host only": lambda: (torch.tensor([1.0, 2.0]) * 2).sum().item(),
    }
    for what, fn in free.items():
        with SyncCounter() as c:
            fn()
        assert c.total == 0, (what, c.ops)


def test_batches_are_padded_to_few_sizes() -> None:
    sizes = {padded(b) for b in range(1, 257)}
    assert sizes == {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256}
    assert all(b <= padded(b) <= max(2, 1.5 * b) for b in range(1, 1000))
