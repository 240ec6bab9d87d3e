"""--draft self: the target drafting with its own layers.

The plan from config.json alone (cards we do not have): the draft's weights are only its copies of the layers
the target streams, resident layers are shared first, --draft-layers auto takes the most that fit and one more
does not fit. The model: its embed/norm/head and resident layers ARE the target's objects, its KV cache has its
own layer count, copies come from (and go into) the layer cache of their format. Exactness: fp32 greedy output
equals the target alone at full and at skipped depth, streamed and resident; a self-draft with every layer in
the target's own format is the target, so a chain draft is accepted whole; sampling keeps the target's
distribution (chi-square: tests/sampling/chi2.py over tests/sampling/sampling_pairs.py). The CLI: plan, generate, chat's default,
bench's self row, models.yaml, one-line errors.
"""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch

from specexec.checkpoints.catalog import SHIPPED_CONFIGS
from cli.main import main
from offload.memory_plan import PlanError
from specexec.builders.specexec import SpecExecBuilder
from specexec.config import EngineConfig, OffloadConfig, SamplingParams
from specexec.decoding.engine import Engine
from specexec.options import ConfigError
from specexec.planning.ledger import card_budget, plan_memory
from specexec.planning.run_shape import RunShape, spaced_layers, with_self_draft
from specexec.planning.sizes import layer_bytes
from specexec.checkpoints.loading import load_model, read_args
from specexec.checkpoints.catalog import parse_catalog
from specexec.planning.target import target_formats
from specexec.runtime.offloaded import HostEmbedding
from specexec.runtime.assembly import Runtime
from specexec.runtime.self_draft import SelfDraft, build_self_draft, self_draft_format
from tests.sampling.chi2 import chi2_pvalue
from tests.sampling.sampling_pairs import exact_pairs, sample_pairs
from tests.runtime.self_draft_cli import self_draft_json
from tests.tiny_models import prompt

CONFIGS = SHIPPED_CONFIGS
T70, Q32, L8 = (CONFIGS / n for n in ("llama-3.1-70b-instruct", "qwen2.5-32b-instruct", "llama-3.1-8b-instruct"))
GB = 10**9
F32 = EngineConfig(budget=8, dtype="float32")


# ----------------------------------------------------------------------------------------- layer choice

def test_spaced_layers_are_even_distinct_and_keep_the_first_and_last() -> None:
    for n in range(2, 90):
        for k in range(2, n + 1):
            ids = spaced_layers(n, k)
            assert len(set(ids)) == k and list(ids) == sorted(ids) and ids[0] == 0 and ids[-1] == n - 1
            gaps = [b - a for a, b in zip(ids, ids[1:])]
            assert max(gaps) - min(gaps) <= 1, (n, k, ids)
    assert spaced_layers(28, 28) == tuple(range(28)) and spaced_layers(28, 2) == (0, 27)


def test_layer_counts_and_formats_are_checked() -> None:
    shape = RunShape(read_args(L8), None, torch.bfloat16, "cuda")
    for bad in (1, 0, 33):
        with pytest.raises(ConfigError, match=f"--draft-layers {bad}: .* 2 to 32 of its 32"):
            with_self_draft(shape, "nf4", bad)
    assert self_draft_format("self", "cpu") == "int4" and self_draft_format("self", "cuda") == "nf4"
    assert self_draft_format("self:int8", "cpu") == "int8" and self_draft_format("self:NONE", "cpu") == "none"
    with pytest.raises(ConfigError, match="'q3' is not a layer format; use self or self:FORMAT"):
        self_draft_format("self:q3", "cpu")


# ----------------------------------------------------------------------------------------- the ledger

def _plan(target: Path, fmt: str, layers: int | None, gpu: int | None, ram: int, mode: str = "auto",
          device: str = "cuda", dtype: torch.dtype = torch.bfloat16, quant: str = "auto"):
    args = read_args(target)
    shape = RunShape(args, None, dtype, device, 64, 4096, draft_kv=SpecExecBuilder().kv_slots)
    return plan_memory(with_self_draft(shape, fmt, layers), target_formats(quant, device), ram, gpu, mode)


def test_streamed_target_the_draft_counts_only_its_copies() -> None:
    """--offload ssd on a CPU: every layer streams, so every draft layer is a copy; embed/norm/head are the
    target's lines (no second copy), the draft KV cache has the draft's layer count."""
    args = read_args(L8)
    m = _plan(L8, "int4", 16, None, 64 * GB, "ssd", "cpu", torch.float32)
    ledger = m.ledger()
    assert m.draft_layers == spaced_layers(32, 16) and m.draft_copies == m.draft_layers
    assert ledger["draft weights"] == 16 * layer_bytes(args, "int4", torch.float32, "cpu")
    plain = plan_memory(RunShape(args, None, torch.float32, "cpu", 64, 4096), ("int4",), 64 * GB, None, "ssd")
    for line in ("target norm/head", "target embed", "target embed (host RAM)"):
        assert ledger.get(line) == plain.ledger().get(line)
    per_slot = 2 * 16 * args.n_kv_heads * args.head_dim * 4
    assert ledger["draft KV cache"] % per_slot == 0
    assert m.self_json()["copy_bytes"] == ledger["draft weights"]


@pytest.mark.parametrize("quant,fmt,gpu_gb", [("nf4", "nf4", 40), ("none", "nf4", 48), ("none", "int8", 80)])
def test_resident_layers_are_shared_first_and_the_ledger_is_exact(quant: str, fmt: str, gpu_gb: int) -> None:
    """A 70B target with a 40-layer self-draft: the plan keeps the draft's layers resident before any other (no
    copy then), copies exactly the draft layers it streams, the ledger fits the budget, and no other resident
    layer would fit (a draft layer costs a layer minus its copy, another layer a whole one). NF4 copies of an
    NF4 target cost what the layer costs, so they are all shared; bf16 layers are partly shared."""
    args = read_args(T70)
    budget = card_budget(gpu_gb * GB)
    m = _plan(T70, fmt, 40, budget, 256 * GB, quant=quant)
    p = m.plan
    resident, ids = set(p.layers_in("resident")), set(m.draft_layers)
    assert resident >= ids or resident <= ids                              # draft layers first
    assert set(m.draft_copies) == ids - resident
    layer, copy = layer_bytes(args, m.fmt, torch.bfloat16, "cuda"), layer_bytes(args, fmt, torch.bfloat16, "cuda")
    assert m.ledger()["draft weights"] == len(m.draft_copies) * copy
    assert p.device_bytes <= budget and len(resident) < 80
    assert p.device_bytes + (layer - copy if m.draft_copies else layer) > budget
    assert bool(m.draft_copies) == (quant == "none")


@pytest.mark.parametrize("target", [T70, Q32])
def test_copies_in_the_targets_format_never_displace_resident_layers(target: Path) -> None:
    """NF4 self-draft of an NF4 target on a 24 GB card: a copy costs what a resident layer costs, so every
    draft layer stays resident and shared (none copied) and the target streams only the others; a layer
    count that cannot all stay resident is refused (auto then picks fewer), not planned as all copies."""
    budget = card_budget(24 * GB)
    m = _plan(target, "nf4", None, budget, 64 * GB)
    resident = set(m.plan.layers_in("resident"))
    assert not m.draft_copies and set(m.draft_layers) <= resident and m.ledger()["draft weights"] == 0
    with pytest.raises(PlanError, match="try fewer --draft-layers"):
        _plan(target, "nf4", read_args(target).n_layers, budget, 64 * GB, quant="nf4")    # all: more than fit


@pytest.mark.parametrize("target", [T70, Q32])
def test_auto_picks_the_most_layers_that_fit(capsys, target: Path) -> None:
    """`specexec plan --draft self` on a 24 GB card from config.json alone: --draft-layers auto's choice fits,
    one layer more does not (or, when the target keeps half its layers or more resident, the choice is half
    of them); the plan prints the choice."""
    code = main(["plan", "--model", str(target), "--draft", "self", "--gpu-memory", "24GB", "--ram-budget", "64GB",
                 "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    obj = json.loads(out)
    sd, n = obj["self_draft"], read_args(target).n_layers
    k = len(sd["layers"])
    assert sd["auto"] and sd["format"] == "nf4" and 2 <= k <= n
    assert obj["ledger"]["draft weights"] == sd["copy_bytes"]
    assert sd["measured_depths"][0] == k and sorted(sd["measured_depths"], reverse=True) == sd["measured_depths"]
    if obj["resident_layers"] >= n // 2:
        assert k == n // 2
    elif k < n:
        with pytest.raises(PlanError):
            _plan(target, "nf4", k + 1, card_budget(24 * GB), 64 * GB)
    code = main(["plan", "--model", str(target), "--draft", "self", "--gpu-memory", "24GB", "--ram-budget", "64GB"])
    text = capsys.readouterr().out
    assert code == 0 and f"--draft-layers auto picked {k} of {n} layers" in text and "draft weights" in text
    ladder = "/".join(map(str, sd["measured_depths"]))
    assert f"at load it measures depths {ladder} of them" in text
    with capsys.disabled():
        print(f"\n--- {target.name} --draft self on 24 GB\n{text}")


def test_a_wholly_resident_target_drafts_with_half_its_layers() -> None:
    m = _plan(L8, "int4", None, None, 200 * GB, device="cpu", dtype=torch.float32)
    assert not m.plan.streams and m.draft_layers == spaced_layers(32, 16) and not m.draft_copies
    assert m.ledger()["draft weights"] == 0


def test_what_fits_names_a_layer_count(capsys) -> None:
    code = main(["plan", "--model", str(T70), "--draft", "self", "--draft-layers", "70", "--gpu-memory", "24GB",
                 "--ram-budget", "64GB"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "--draft-layers" in err and "would fit" in err


# ----------------------------------------------------------------------------------------- the model

def test_shares_the_targets_tensors_and_sizes_its_own_cache(tiny_pair, tmp_path) -> None:
    """Streamed target (--offload ssd, fp32 layers): the draft's embedding (a HostEmbedding here), norm and head
    are the target's modules; its layers are copies; unquantized copies compute exactly the target."""
    off = OffloadConfig(quant="none", offload="ssd", cache_dir=str(tmp_path), draft_layers=4,
                        ram_budget=4 << 30)   # not free RAM: 0 on a machine short of memory
    rt = Runtime.load(str(tiny_pair[0]), "self:none", F32, offload=off)
    target, draft = rt.engine.target, rt.engine.draft
    try:
        assert isinstance(draft, SelfDraft) and draft.args.n_layers == 4 and draft.copies == (0, 1, 2, 3)
        assert draft.embed_tokens is target.embed_tokens and draft.norm is target.norm
        assert draft.lm_head is target.lm_head and isinstance(target.embed_tokens, HostEmbedding)
        ids = torch.tensor([prompt(3)])
        pos = torch.arange(ids.shape[1])[None]
        with torch.inference_mode():
            assert torch.equal(draft.logits(draft(ids, pos)), target.logits(target(ids, pos)))
    finally:
        rt.engine.close()


def _over_a_host_embedding(path: Path, root: Path, device: str) -> tuple[list[int], list[int], list[int], Engine]:
    """A self-draft (every layer, unquantized copies) over a streamed target whose embedding table stays in host
    RAM: (its greedy tokens, again, the target alone's, the engine)."""
    from offload.cache.store import LayerCache
    from specexec.checkpoints.naming import layer_names
    from specexec.runtime.offloaded import build_offloaded

    args, dev = read_args(path), torch.device(device)
    names = layer_names(path, args)
    cache = LayerCache.open_or_build(path, names, "none", torch.float32, cache_root=root, progress=False)
    target = build_offloaded(path, args, cache, ["ssd"] * args.n_layers, dev, torch.float32, embed_on_host=True)
    draft = build_self_draft(target, tuple(range(args.n_layers)), "none", path, names, root)
    assert isinstance(draft.embed_tokens, HostEmbedding)
    engine = Engine(target, draft, EngineConfig(budget=16, device=device), SpecExecBuilder())
    alone = Engine(target, None, EngineConfig(budget=1, device=device), None)
    ids = prompt(4)
    got = [t for s in engine.generate(ids, 24) for t in s]
    again = [t for s in engine.generate(ids, 24) for t in s]
    return got, again, [t for s in alone.generate(ids, 24) for t in s], engine


def test_a_draft_over_a_host_embedding_equals_the_target(tiny_pair, tmp_path) -> None:
    got, again, want, engine = _over_a_host_embedding(tiny_pair[0], tmp_path, "cpu")
    engine.close()
    assert got == again == want


@pytest.mark.gpu
def test_on_cuda_a_draft_over_a_host_embedding_runs_in_graphs(tiny_pair, tmp_path) -> None:
    """The host embedding copies the ids to the host: no graph can hold it. The draft's graphs start after it,
    so they capture and replay (before, its .cpu() inside the capture turned graphs off), and fp32 greedy
    output equals the target alone's."""
    from specexec.builders import draft_graphs

    got, again, want, engine = _over_a_host_embedding(tiny_pair[0], tmp_path, "cuda")
    try:
        runner = draft_graphs.runner(engine.draft, engine._caches[1], None)
        assert got == again == want
        assert runner is not None and runner.graphs and not runner.failed
    finally:
        engine.close()


def test_resident_layers_are_the_targets_own_blocks(tiny_pair, tmp_path) -> None:
    target = load_model(tiny_pair[0])
    draft = build_self_draft(target, (0, 3), "int4")
    assert [b is target.layers[i] for b, i in zip(draft.layers, (0, 3))] == [True, True]
    assert draft.shared == (0, 3) and not draft.copies
    engine = Engine(target, draft, EngineConfig(budget=6), SpecExecBuilder())
    list(engine.generate(prompt(0), 3))
    assert engine._caches[1].k.shape[0] == 2 and engine._caches[0].k.shape[0] == 4


def test_copies_come_from_their_formats_cache_built_once(tiny_pair, tmp_path) -> None:
    """A self:int8 draft of an int4-streamed target builds the int8 cache once (progress through the callback,
    with a bar); a second start reads it; with the target's own format nothing is built at all."""
    def start(spec: str) -> list[str]:
        said: list[str] = []
        off = OffloadConfig(offload="ssd", cache_dir=str(tmp_path), draft_layers=2)
        rt = Runtime.load(str(tiny_pair[0]), spec, F32, offload=off, progress=said.append)
        rt.engine.close()
        return said

    first, again = start("self:int8"), start("self:int8")
    assert any("packing the target's layers int8" in s and "4/4" in s and "█" in s for s in first)
    assert not any("packing" in s for s in again) and any("int8 copies" in s and "2/2" in s for s in again)
    assert not any("packing the target's layers" in s for s in start("self"))   # the target's int4 cache


# ----------------------------------------------------------------------------------------- exactness

@pytest.mark.parametrize("spec,offload,layers", [("self", "ssd", 4), ("self", "ssd", 2), ("self:int8", "ssd", 3),
                                                 ("self", "auto", 2)])
def test_greedy_equals_the_target_alone(tiny_pair, tmp_path, spec: str, offload: str, layers: int) -> None:
    off = OffloadConfig(offload=offload, cache_dir=str(tmp_path), draft_layers=layers)
    rt = Runtime.load(str(tiny_pair[0]), spec, F32, offload=off)
    try:
        assert rt.engine.draft.args.n_layers == layers
        for seed in (0, 1):
            ids = prompt(seed)
            got = [t for s in rt.generate_ids(ids, 24) for t in s]
            want = [t for s in rt.variant(F32, use_draft=False).generate_ids(ids, 24) for t in s]
            assert got == want
    finally:
        rt.engine.close()


def test_every_layer_in_the_targets_format_is_the_target(tiny_pair, tmp_path) -> None:
    """int4 copies of every layer of an int4-streamed target: the draft computes what the target computes
    (row-exact kernel), so every chain of 5 is accepted: 6 tokens per target pass."""
    off = OffloadConfig(offload="ssd", cache_dir=str(tmp_path))
    rt = Runtime.load(str(tiny_pair[0]), "self", F32.replace(builder="chain", budget=5), offload=off)
    try:
        assert rt.engine.draft.args.n_layers == 4 and rt.engine.draft.fmt == "int4"
        out = [t for s in rt.generate_ids(prompt(2), 30) for t in s]
        assert len(out) == 30 and rt.stats()["steps"] == 5
    finally:
        rt.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("verifier,temperature,layers", [("sample_match", 1.0, (0, 3)), ("rrs", 0.6, (0, 2, 3))])
def test_sampling_keeps_the_target_distribution(tiny_pair, verifier: str, temperature: float,
                                                layers: tuple[int, ...]) -> None:
    target = load_model(tiny_pair[0])
    draft = build_self_draft(target, layers, "none")
    sampling = SamplingParams(temperature=temperature, top_p=0.95)
    engine = Engine(target, draft, EngineConfig(budget=4, verifier=verifier), SpecExecBuilder())
    trials = 320
    counts = sample_pairs(engine, sampling, trials)
    assert chi2_pvalue(counts, exact_pairs(target, sampling)) > 1e-3


@pytest.mark.gpu
def test_on_cuda_copies_live_on_the_gpu_and_run_the_drafts_kernel(tiny_pair, tmp_path) -> None:
    """CUDA: the NF4 copies sit on the GPU (one region), run bitsandbytes' fused 4-bit GEMM where it exists
    (a draft may), and fp32 greedy output still equals the target alone."""
    from offload.quant.linear import _bnb_gemm_4bit, pass_traffic

    off = OffloadConfig(offload="ssd", cache_dir=str(tmp_path), draft_layers=4)
    config = EngineConfig(budget=8, dtype="float32", device="cuda")
    rt = Runtime.load(str(tiny_pair[0]), "self", config, offload=off)
    try:
        draft = rt.engine.draft
        assert draft.fmt == "nf4" and draft.copies == (0, 1, 2, 3)
        assert all(t.device.type == "cuda" for t in draft.layers.buffers())
        kernels = pass_traffic(draft.layers, "cuda")["kernels"]
        assert set(kernels) == ({"bnb-4bit"} if _bnb_gemm_4bit() else {"dequantize"})
        ids = prompt(4)
        got = [t for s in rt.generate_ids(ids, 16) for t in s]
        assert got == [t for s in rt.variant(config, use_draft=False).generate_ids(ids, 16) for t in s]
    finally:
        rt.engine.close()


# ----------------------------------------------------------------------------------------- the CLI

def test_generate_with_self_equals_no_draft(capsys, tiny_pair, tmp_path) -> None:
    out, err, want = self_draft_json(capsys, tiny_pair[0], tmp_path, "--draft", "self", "--draft-layers", "2")
    assert out["token_ids"] == want
    assert "draft self (2 of 4 layers [0, 3]: 0 shared, 2 int4 copies)" in err


def test_chat_without_a_draft_drafts_with_itself(monkeypatch, capsys, tiny_pair) -> None:
    common = ["--model", str(tiny_pair[0]), "--max-new-tokens", "10", "--dtype", "float32"]
    assert main(["generate", *common, "--no-draft", "--chat", "--prompt", "Hello there", "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)["text"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n"))
    assert main(["chat", *common]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_bench_has_a_self_row_beside_the_model_draft(capsys, tiny_pair, tiny_perturbed_draft, tmp_path) -> None:
    code = main(["bench", "--model", str(tiny_pair[0]), "--drafts", f"{tiny_perturbed_draft},self", "--dtype",
                 "float32", "--limit", "2", "--max-new-tokens", "8", "--warmup", "0", "--budgets", "4",
                 "--configs", "specexec,no-draft", "--offload", "ssd", "--cache-dir", str(tmp_path), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    rows = json.loads(captured.out)["rows"]
    assert [(r["config"], r["draft"]) for r in rows] == [("specexec budget=4", str(tiny_perturbed_draft)),
                                                         ("self budget=4", "self"), ("no-draft", None)]
    assert all(r["identical_to_baseline"] for r in rows)
    assert all(r["draft_ms_per_step"] > 0 for r in rows[:2]) and rows[2]["draft_ms_per_step"] == 0
    code = main(["bench", "--model", str(tiny_pair[0]), "--drafts", "self", "--draft-layers", "3", "--limit", "1",
                 "--max-new-tokens", "4", "--warmup", "0", "--budgets", "4", "--configs", "specexec", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert [r["config"] for r in json.loads(captured.out)["rows"]] == ["self budget=4"]


ERRORS = {
    "bad format": (["--draft", "self:q3"], "'q3' is not a layer format"),
    "layers without self": (["--no-draft", "--draft-layers", "2"], "--draft-layers applies to --draft self"),
    "layers word": (["--draft", "self", "--draft-layers", "many"], "--draft-layers 'many'"),
    "too many layers": (["--draft", "self", "--draft-layers", "9"], "--draft-layers 9: a self-draft of this target"),
    "draft-quant": (["--draft", "self", "--draft-quant", "int8"], "self:int8"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_user_errors_are_one_line(capsys, tiny_pair, tmp_path, case: str) -> None:
    extra, needle = ERRORS[case]
    code = main(["generate", "--model", str(tiny_pair[0]), "--prompt", "hi", "--cache-dir", str(tmp_path), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and needle in err, err


CATALOG = """
version: 1
models:
  big:
    hub: org/big
    family: llama
    params: 70B
    drafts: {drafts}
"""


def test_models_yaml_drafts_may_say_self() -> None:
    assert parse_catalog(CATALOG.format(drafts="self")).get("big").drafts == ("self",)
    assert parse_catalog(CATALOG.format(drafts="[self:int8]")).get("big").drafts == ("self:int8",)
    with pytest.raises(ConfigError, match="'q3' is not a layer format"):
        parse_catalog(CATALOG.format(drafts="[self:q3]"))
