"""The families added beside the first ones (GLM-4.5+ MoE, MiniMax-M2, DeepSeek-V3, Gemma 4) through every path a
user can pick, fp32 greedy ids against transformers' own `generate` on the same tiny checkpoints:
- every registered tree builder with a perturbed draft, resident (tests/network/test_moe.py covers --no-draft and
  the SSD tier with and without a draft for each MoE family);
- the target streamed from the RAM tier with --experts cpu, and from the SSD tier with the device expert cache
  and expert-aware trees;
- a GLM checkpoint holding its next-token-prediction layer after the decoder (as the Hub's do) loads with that
  layer left unread, and a layer beyond it is still refused.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from specexec.builders.registry import make_builder, names as builder_names
from specexec.checkpoints.loading import load_model
from specexec.config import EngineConfig, OffloadConfig
from specexec.decoding.engine import Engine
from specexec.runtime.assembly import Runtime
from tests.network.model_reference import hf_model
from tests.tiny_models import DRAFT_PERTURB, write_tiny_model

FAMILIES = ["glm4_moe", "minimax_m2", "deepseek_v3", "gemma4_moe"]       # MoE: every path below
DENSE = ["gemma4"]                                                           # every builder
N_NEW = 20


def prompt(seed: int) -> list[int]:
    return torch.randint(7, 300, (11,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(path: Path, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf_model(path).generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def same(got: list[int], want: list[int], eos: set[int]) -> bool:
    """Equal ids; we stop at an EOS transformers (told no EOS) runs past."""
    return got == want[:len(got)] and (len(got) == len(want) or got[-1] in eos)


def draft_of(root: Path, target: Path) -> Path:
    dest = root / f"{target.name}-builders-draft"
    if not (dest / "config.json").exists():
        write_tiny_model(dest, perturb=DRAFT_PERTURB, base=target, seed=41)
    return dest


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}")


@pytest.fixture(scope="module", params=FAMILIES + DENSE)
def any_family(request: pytest.FixtureRequest, tiny_root: Path) -> Path:
    if request.param in DENSE:
        from tests.tiny_models import family_model
        return family_model(tiny_root, request.param)
    return request.getfixturevalue(f"tiny_{request.param}")


@pytest.mark.slow
def test_every_builder_gives_transformers_greedy_ids(any_family: Path, tiny_root: Path) -> None:
    family = any_family
    target, draft = load_model(family), load_model(draft_of(tiny_root, family))
    ids = prompt(1)
    want = hf_greedy(family, ids)
    for name in builder_names():
        builder = make_builder(name)
        engine = Engine(target, draft if builder.needs_draft else None, EngineConfig(budget=8, builder=name),
                        builder)
        got = [t for step in engine.generate(ids, N_NEW) for t in step]
        assert same(got, want, set(engine.eos_ids)), name
        if builder.needs_draft:
            assert len(engine.stats.steps) < len(got), name          # the draft's trees were accepted


@pytest.mark.parametrize("offload, experts", [("ram", "cpu"), ("ssd", "stream")],
                         ids=["ram-experts-cpu", "ssd-experts-streamed"])
def test_streamed_moe_paths_give_transformers_greedy_ids(family: Path, tiny_root: Path, tmp_path: Path,
                                                          offload: str, experts: str) -> None:
    ids = prompt(2)
    want = hf_greedy(family, ids)
    off = OffloadConfig(quant="none", offload=offload, cache_dir=str(tmp_path), experts=experts)
    rt = Runtime.load(str(family), str(draft_of(tiny_root, family)), EngineConfig(budget=8, dtype="float32"),
                      offload=off)
    try:
        got = [t for step in rt.generate_ids(ids, N_NEW) for t in step]
        assert same(got, want, set(rt.engine.eos_ids))
        moe = rt.stats()["moe"]
        if experts == "cpu":
            assert moe["cpu_expert_rows_per_pass"] > 0 and moe["expert_bytes_per_pass"] == 0
        else:
            assert moe["expert_bytes_per_pass"] > 0
    finally:
        rt.engine.close()


def test_the_expert_cache_serves_a_tree_pass_bit_for_bit(family: Path, tmp_path: Path) -> None:
    """Every layer on the SSD tier, 3 experts of each sparse layer kept on the device: three tree passes (the
    cache fills, then serves) give the resident model's logits bit for bit."""
    from specexec.network.model import TreeMask
    from specexec.tree import TokenTree
    from tests.network.model_reference import new_cache, prefill
    from tests.runtime.offloaded_models import offloaded

    ref = load_model(family)
    model = offloaded(family, "none", ["ssd"] * ref.args.n_layers, tmp_path, expert_cache=3)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(7, 300, (9,), generator=g)

    def tree_logits(m, tree: TokenTree) -> torch.Tensor:
        cache = new_cache(m)
        prefill(m, cache, ids)
        L = cache.length
        return m.logits(m(tree.tokens[None], tree.positions(L)[None], TreeMask(L, tree.ancestor_mask()), cache))

    try:
        for step in range(3):
            tree = TokenTree.from_lists(torch.randint(7, 300, (10,), generator=g).tolist(),
                                        [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6])
            with torch.inference_mode():
                assert torch.equal(tree_logits(model, tree), tree_logits(ref, tree)), step
        assert model.expert_counters()["expert_hits"] > 0
    finally:
        model.close()


SSE_PASS = """
import sys, torch
from pathlib import Path
from specexec.checkpoints.loading import load_model
from specexec.network.model import TreeMask
from specexec.tree import TokenTree
from tests.network.model_reference import new_cache, prefill
from tests.runtime.offloaded_models import offloaded
path, root = Path(sys.argv[1]), Path(sys.argv[2])
ref = load_model(path)
model = offloaded(path, "none", ["ssd"] * ref.args.n_layers, root, expert_cache=3)
g = torch.Generator().manual_seed(4)
ids = torch.randint(7, 300, (9,), generator=g)
tree = TokenTree.from_lists(torch.randint(7, 300, (10,), generator=g).tolist(), [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6])
out = []
with torch.inference_mode():
    for m in (model, ref):
        cache = new_cache(m)
        prefill(m, cache, ids)
        L = cache.length
        out.append(m.logits(m(tree.tokens[None], tree.positions(L)[None], TreeMask(L, tree.ancestor_mask()), cache)))
model.close()
print("equal" if torch.equal(*out) else f"differ {(out[0] - out[1]).abs().max().item():.3g}")
"""


@pytest.mark.slow          # a fresh interpreter (~10 s)
@pytest.mark.skipif(not torch.backends.mkl.is_available() or __import__("platform").machine() != "x86_64",
                    reason="emulates MKL's code path on an AMD CPU")
def test_the_expert_cache_is_bit_for_bit_on_mkls_sse_path(tiny_minimax_m2: Path, tmp_path: Path) -> None:
    """The test above under MKL's SSE4.2 kernels (what MKL runs on many non-Intel CPUs): its one-row GEMVs round
    by the weight's address, so the resident model's weights must sit aligned as the streamed ones do (issue 55:
    it failed on an AMD EPYC while passing on Intel's AVX-512 path)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "PYTHONPATH": str(Path(__file__).parents[2])}
    run = subprocess.run([sys.executable, "-c", SSE_PASS, str(tiny_minimax_m2), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "equal"


# ------------------------------------------------------------------------ GLM's next-token-prediction layer

def with_mtp_layer(src: Path, dest: Path, index: int) -> Path:
    """A copy of a tiny GLM checkpoint with an MTP layer's tensors stored as decoder layer `index` (the Hub's
    layout: eh_proj, enorm, hnorm, shared_head.norm beside a decoder layer's own tensors)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    tensors = load_file(dest / "model.safetensors")
    extra = {"eh_proj.weight": torch.zeros(64, 128), "enorm.weight": torch.ones(64), "hnorm.weight": torch.ones(64),
             "shared_head.norm.weight": torch.ones(64), "input_layernorm.weight": torch.ones(64)}
    tensors.update({f"model.layers.{index}.{k}": v for k, v in extra.items()})
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_the_mtp_layer_is_left_unread_and_one_more_layer_is_refused(tiny_glm4_moe: Path, tmp_path: Path) -> None:
    from offload.formats.checkpoint import CheckpointError

    n = load_model(tiny_glm4_moe).args.n_layers
    ok = load_model(with_mtp_layer(tiny_glm4_moe, tmp_path / "mtp", n))
    assert ok.args.mtp_layers == 1 and len(ok.layers) == n
    ids = torch.tensor([prompt(3)])
    with torch.inference_mode():
        plain = load_model(tiny_glm4_moe)
        assert torch.equal(ok.logits(ok(ids, torch.arange(11)[None])), plain.logits(plain(ids, torch.arange(11)[None])))
    with pytest.raises(CheckpointError, match=rf"unexpected tensor 'model\.layers\.{n + 1}\."):
        load_model(with_mtp_layer(tiny_glm4_moe, tmp_path / "extra", n + 1))
