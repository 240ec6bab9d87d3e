"""OffloadedTransformer: the same numbers as the resident model with the same quantization, for every tier mix
(all resident, all RAM, all SSD, mixed) and every family; greedy decoding through the engine is unchanged;
Runtime/CLI integration (quant auto, plans, stream stats, one-line budget errors); and peak memory with the
SSD tier under a tight --ram-budget (anonymous RSS, measured in a fresh process)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cli.main import main
from offload.quant.linear import QuantLinear
from specexec.builders.specexec import SpecExecBuilder
from specexec.config import EngineConfig, OffloadConfig
from specexec.decoding.engine import Engine
from specexec.kv.cache import KVCache
from specexec.options import ConfigError
from specexec.checkpoints.loading import load_model, read_args
from specexec.network.model import prefix_tree_mask
from specexec.runtime.offloaded import OffloadedTransformer, build_offloaded
from specexec.builders.registry import make_builder, names as builder_names
from specexec.runtime.assembly import Runtime
from tests.runtime.offloaded_models import CPU, offloaded, open_cache, reference
from tests.tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
MIXES = {
    "resident": ["resident"] * 4,
    "ram": ["ram"] * 4,
    "ssd": ["ssd"] * 4,
    "mixed": ["resident", "ssd", "ram", "ssd"],
}


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("layer-cache")


def cached_forward(model, n_prefix: int = 9, n_tree: int = 6) -> torch.Tensor:
    """Prefill a prefix into a KV cache, then one tree-shaped pass (siblings share positions): hidden of both."""
    a = model.args
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, 32, torch.float32, CPU)
    prefix = torch.randint(7, 300, (1, n_prefix), generator=gen)
    pos = torch.arange(n_prefix)
    h1 = model(prefix, pos[None], prefix_tree_mask(0, torch.ones(n_prefix, n_prefix).tril().bool()), cache)
    cache.advance(n_prefix)
    parents = [-1, 0, 0, 1, 1, 2][:n_tree]
    anc = torch.zeros(n_tree, n_tree, dtype=torch.bool)
    depth = []
    for i, p in enumerate(parents):
        anc[i, i] = True
        if p >= 0:
            anc[i] |= anc[p]
        depth.append(0 if p < 0 else depth[p] + 1)
    tree = torch.randint(7, 300, (1, n_tree), generator=gen)
    tpos = n_prefix + torch.tensor(depth)
    h2 = model(tree, tpos[None], prefix_tree_mask(n_prefix, anc), cache)
    return torch.cat([h1, h2], dim=1)


@pytest.mark.parametrize("fmt", ["none", "nf4", "int4"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_offloaded_forward_equals_resident_with_the_same_quantization(tiny_pair, cache_root, fmt: str,
                                                                       mix: str) -> None:
    target = tiny_pair[0]
    want = cached_forward(reference(target, fmt))
    model = offloaded(target, fmt, MIXES[mix], cache_root)
    try:
        for _ in range(2):                          # the second pass runs on prefetched slots
            assert torch.equal(cached_forward(model), want)
        streamed = [t for t in MIXES[mix] if t != "resident"]
        assert (model.pager.stats.streamed > 0) == bool(streamed)
    finally:
        model.close()


def test_every_family_mixed_tiers(tiny_model, cache_root) -> None:
    """Biases (qwen2), tied head (qwen2_tied), q/k norms (qwen3), rope scaling (llama3): 2 layers, ram + ssd."""
    want = cached_forward(reference(tiny_model, "int8"))
    model = offloaded(tiny_model, "int8", ["ssd", "ram"], cache_root)
    try:
        assert torch.equal(cached_forward(model), want)
        assert isinstance(next(model.layer_modules())[1].self_attn.q_proj, QuantLinear)
    finally:
        model.close()


@pytest.mark.parametrize("budget", [1, 8, 32])
def test_greedy_generation_through_the_offloaded_target_is_unchanged(tiny_pair, tiny_perturbed_draft, cache_root,
                                                                     budget: int) -> None:
    target = tiny_pair[0]
    draft = load_model(tiny_perturbed_draft)
    ids = torch.randint(7, 300, (14,), generator=torch.Generator().manual_seed(budget)).tolist()

    def run(model, with_draft: bool) -> list[int]:
        engine = Engine(model, draft if with_draft else None, EngineConfig(budget=budget),
                        SpecExecBuilder() if with_draft else None)
        return [t for step in engine.generate(ids, 30) for t in step]

    ref = reference(target, "nf4")
    want = run(ref, False)
    assert run(ref, True) == want
    model = offloaded(target, "nf4", MIXES["mixed"], cache_root)
    try:
        assert run(model, True) == want
        assert run(model, False) == want
    finally:
        model.close()


INT4_BUDGETS = (1, 8, 32)


def int4_prompt(budget: int) -> list[int]:
    return torch.randint(7, 300, (14,), generator=torch.Generator().manual_seed(budget)).tolist()


@pytest.fixture(scope="module")
def int4_alone(tiny_pair, cache_root) -> dict[int, list[int]]:
    """budget -> the 30 tokens the streamed int4 target gives decoding alone (one token per pass) after
    int4_prompt(budget): the same for every builder, so decoded once per module."""
    model = offloaded(tiny_pair[0], "int4", MIXES["mixed"], cache_root)
    try:
        return {b: [t for step in Engine(model, None, EngineConfig(budget=1), None).generate(int4_prompt(b), 30)
                    for t in step] for b in INT4_BUDGETS}
    finally:
        model.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", builder_names())
def test_greedy_output_with_an_int4_target_equals_that_target_alone(tiny_pair, tiny_perturbed_draft, cache_root,
                                                                    int4_alone, name: str) -> None:
    """Every builder, budgets 1/8/32: the int4 target streamed (mixed tiers, bf16 kernels, fp32 residual stream)
    verifying trees gives exactly the tokens the same int4 target gives decoding alone, one token per pass.
    (The int4 linears are row-exact; what is not is CPU attention's last bit between a tree pass and a
    one-token pass, which the kernels' bf16 rounding enlarges to a bf16 ulp. These prompts have no near-tie
    it flips; chat-template prompts on the tiny pair do, once in 12x32 tokens.)"""
    target = tiny_pair[0]
    draft = load_model(tiny_perturbed_draft)
    model = offloaded(target, "int4", MIXES["mixed"], cache_root)
    try:
        for budget in INT4_BUDGETS:
            builder = make_builder(name)
            engine = Engine(model, draft if builder.needs_draft else None, EngineConfig(budget=budget, builder=name),
                            builder)
            got = [t for step in engine.generate(int4_prompt(budget), 30) for t in step]
            assert got == int4_alone[budget], f"{name} budget={budget}"
            assert max(s.tree_size for s in engine.stats.steps) > 1 or budget == 1 or not builder.needs_draft
    finally:
        model.close()


# ------------------------------------------------------------------------------------------------ Runtime

def ids_of(rt: Runtime, text: str = "The quick brown fox", n: int = 12) -> list[int]:
    return [t for step in rt.generate_ids(rt.encode(text), n) for t in step]


def test_runtime_ssd_tier_matches_resident_and_reports_streaming(tiny_pair, tiny_perturbed_draft, cache_root,
                                                                 posix_facilities) -> None:
    """Also without the POSIX-only facilities (conftest.posix_facilities): the same tokens through the SSD tier."""
    config = EngineConfig(budget=8, max_new_tokens=12)
    common = {"quant": "nf4", "cache_dir": str(cache_root)}
    resident = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config,
                            offload=OffloadConfig(offload="none", **common))
    ssd = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config,
                       offload=OffloadConfig(offload="ssd", **common))
    assert ids_of(ssd) == ids_of(resident)
    assert resident.plan.plan.layers_in("resident") == [0, 1, 2, 3]
    assert ssd.plan.plan.layers_in("ssd") == [0, 1, 2, 3] and ssd.plan.fmt == "nf4"
    stats = ssd.stats()
    assert stats["bytes_streamed"] >= stats["passes"] * sum(ssd.plan.plan.needs.layer_bytes) > 0
    assert stats["ssd_bytes"] == stats["bytes_streamed"] and stats["ssd_gbps"] > 0
    assert stats["stall_ms"] >= 0 and stats["offload"]["ssd_layers"] == 4
    assert {"steps", "tokens_per_step", "decode_tok_s"} <= set(stats)          # the engine's keys are kept
    assert "SSD tier" in ssd.plan.notice() and "nf4" in ssd.plan.notice()
    assert ssd.target_info.dtype == "float32 (nf4 layers)"
    variant = ssd.variant(config.replace(budget=2), use_draft=False)
    assert ids_of(variant) == ids_of(resident)


def test_quant_auto_is_none_while_resident_and_int4_once_streaming_on_a_cpu(tiny_pair, cache_root) -> None:
    config = EngineConfig(max_new_tokens=4)
    plain = Runtime.load(str(tiny_pair[0]), None, config, offload=OffloadConfig(cache_dir=str(cache_root)))
    assert plain.plan.fmt == "none" and not plain.plan.offloaded
    assert type(plain.engine.target).__name__ == "Transformer" and plain.plan.notice() == ""
    streamed = Runtime.load(str(tiny_pair[0]), None, config,
                            offload=OffloadConfig(offload="ram", cache_dir=str(cache_root)))
    assert streamed.plan.fmt == "int4" and isinstance(streamed.engine.target, OffloadedTransformer)
    layer = next(streamed.engine.target.layer_modules())[1]
    assert layer.mlp.up_proj.kernel() == "int4-cpu" and layer.input_layernorm.weight.dtype == torch.float32
    forced = Runtime.load(str(tiny_pair[0]), None, config,
                          offload=OffloadConfig(offload="ram", quant="none", cache_dir=str(cache_root)))
    assert forced.plan.fmt == "none" and ids_of(forced, n=4) == ids_of(plain, n=4)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_draft_quant_keeps_greedy_output(tiny_pair, tiny_perturbed_draft, cache_root, fmt: str) -> None:
    config = EngineConfig(budget=8, max_new_tokens=12)
    base = Runtime.load(str(tiny_pair[0]), None, config)
    rt = Runtime.load(str(tiny_pair[0]), str(tiny_perturbed_draft), config,
                      offload=OffloadConfig(draft_quant=fmt, cache_dir=str(cache_root)))
    down = rt.engine.draft.layers[0].mlp.down_proj
    assert isinstance(down, QuantLinear) and down.kernel() == f"{fmt}-cpu" and not down.row_exact
    assert f"{fmt} layers" in rt.draft_info.dtype and rt.draft_info.dtype.startswith("float32")   # fp32 on CPU
    assert ids_of(rt) == ids_of(base)


def test_impossible_budget_is_one_config_error_line(tiny_pair, cache_root) -> None:
    with pytest.raises(ConfigError) as e:
        Runtime.load(str(tiny_pair[0]), None, EngineConfig(),
                     offload=OffloadConfig(ram_budget=1000, cache_dir=str(cache_root)))
    assert "\n" not in str(e.value) and "--ram-budget" in str(e.value) and "at least" in str(e.value)


def test_cli_generate_offloaded(capsys, tiny_pair, cache_root) -> None:
    argv = ["generate", "--model", str(tiny_pair[0]), "--no-draft", "--prompt", "Hello", "--max-new-tokens", "6",
            "--offload", "ssd", "--quant", "nf4", "--cache-dir", str(cache_root), "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    stats = json.loads(captured.out)["stats"]
    assert stats["bytes_streamed"] > 0 and "ssd_gbps" in stats and "stall_ms" in stats
    assert "offload plan (ssd" in captured.err and "SSD tier" in captured.err
    assert main(argv[:-1] + ["--quant", "q3"]) == 2
    assert "unknown --quant 'q3'; choose one of" in capsys.readouterr().err
    assert main(argv[:-1] + ["--ram-budget", "1kB"]) == 2
    assert "error: --ram-budget" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ memory

MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    from specexec.config import EngineConfig, OffloadConfig
    from specexec.decoding.engine import Engine
    from specexec.checkpoints.loading import expected_shapes, read_args
    from specexec.planning.target import plan_target
    from specexec.runtime.offloaded import load_target

    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    path, root, budget = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    args, config = read_args(path), EngineConfig(budget=4, max_new_tokens=3)
    offload = OffloadConfig(quant="none", ram_budget=budget, cache_dir=root)
    expected_shapes(args)      # one-time library state (torch's meta-device registrations, ~65 MB): not run data
    peak, done = [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon()); time.sleep(0.002)
    base = anon()
    threading.Thread(target=sample, daemon=True).start()
    tp = plan_target(path, args, None, offload, config, torch.device("cpu"), torch.float32)
    model = load_target(path, args, tp, offload, torch.device("cpu"), torch.float32)
    ids = [t for step in Engine(model, None, config, None).generate(list(range(10, 30)), 3) for t in step]
    done.set(); model.close()
    print(json.dumps({"base": base, "peak": max(peak[0], anon()), "plan": tp.plan.summary(), "tokens": len(ids)}))
""")
OVERHEAD = 32 * 2**20       # stated overhead beyond --ram-budget: allocator slack, python objects, thread stacks


def wide_checkpoint(dest: Path, n_layers: int) -> Path:
    """A Llama checkpoint with 16 MB fp32 layers: one layer written by transformers, then n_layers random copies
    of its shapes written straight to safetensors (initializing a wide model through transformers is slow)."""
    from safetensors.torch import load_file, save_file

    write_tiny_model(dest, "llama", seed=3, n_layers=1, hidden_size=512, intermediate_size=2048,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    state = load_file(dest / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    layer0 = {k: v for k, v in state.items() if ".layers.0." in k}
    for i in range(1, n_layers):
        for k, v in layer0.items():
            state[k.replace(".layers.0.", f".layers.{i}.")] = torch.randn(v.shape, generator=gen) * v.std()
    save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": n_layers}))
    return dest


@pytest.mark.slow
def test_ssd_tier_peak_anonymous_memory_stays_within_the_ram_budget(tmp_path) -> None:
    wide = wide_checkpoint(tmp_path / "wide", n_layers=8)
    root = tmp_path / "cache"
    cache = open_cache(wide, "none", root)
    layer, total = cache.max_nbytes, cache.total_nbytes
    cache.close()
    budget = 64 * 2**20
    assert total > budget + OVERHEAD and layer > 14 * 2**20       # all-resident would fail the check below
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(wide), str(root), str(budget)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["tokens"] == 3 and r["plan"]["ssd_layers"] >= 6 and r["plan"]["device_bytes"] <= budget
    grown = r["peak"] - r["base"]
    assert grown <= budget + OVERHEAD, f"anonymous RSS grew by {grown / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------------ CUDA

@pytest.mark.gpu
@pytest.mark.parametrize("mix", list(MIXES))
def test_cuda_offloaded_forward_equals_resident(tiny_pair, cache_root, mix: str) -> None:
    target = tiny_pair[0]
    cuda = torch.device("cuda")
    ref = reference(target, "nf4").to(cuda)
    model = build_offloaded(target, read_args(target), open_cache(target, "nf4", cache_root), MIXES[mix], cuda,
                            torch.float32)
    try:
        tokens = torch.randint(7, 300, (1, 11), device=cuda)
        pos = torch.arange(11, device=cuda)[None]
        for _ in range(3):
            assert torch.equal(model(tokens, pos), ref(tokens, pos))
        if mix in ("ram", "mixed"):
            assert model.pager.ram.region.is_pinned()
    finally:
        model.close()


@pytest.mark.gpu
def test_cuda_runtime_streams_and_matches(tiny_pair, tiny_perturbed_draft, cache_root) -> None:
    config = EngineConfig(budget=8, max_new_tokens=12, device="cuda", dtype="float32")
    common = {"quant": "nf4", "cache_dir": str(cache_root)}
    target, draft = str(tiny_pair[0]), str(tiny_perturbed_draft)
    a = Runtime.load(target, draft, config, offload=OffloadConfig(offload="none", **common))
    b = Runtime.load(target, draft, config, offload=OffloadConfig(offload="ssd", **common))
    assert ids_of(a) == ids_of(b)
    assert b.stats()["bytes_streamed"] > 0


def test_an_int4_target_on_a_cpu_computes_its_head_in_int8(tiny_qwen2_tied, cache_root) -> None:
    """Beside int4/int8 layers on a CPU the LM head is an int8 copy run by the integer kernel (the tied
    embedding stays for lookups): logits close to the fp32 head's, the same bits for a row in any batch."""
    rt = Runtime.load(str(tiny_qwen2_tied), None, EngineConfig(budget=4, max_new_tokens=4),
                      offload=OffloadConfig(quant="int4", cache_dir=str(cache_root)))
    model = rt.engine.target
    head = model.lm_head
    assert isinstance(head, QuantLinear) and head.kernel() == "int8-cpu" and "int8 head" in rt.target_info.dtype
    h = torch.randn(5, model.args.dim, generator=torch.Generator().manual_seed(0))
    got, fp32 = model.logits(h), F.linear(h, model.embed_tokens.weight)
    assert ((got - fp32).norm() / fp32.norm()).item() < 0.02
    assert torch.equal(model.logits(h[2:3]), got[2:3])


def test_an_int4_draft_on_a_cpu_computes_its_head_in_int4_and_the_output_stays_the_targets(tiny_qwen2_tied,
                                                                                          cache_root) -> None:
    """--draft-quant int4 on a CPU gives the draft an int4 head (its rounding changes what it proposes, never
    what is accepted) while the target's stays int8: the ids equal the target alone's."""
    config = EngineConfig(budget=4, max_new_tokens=12)
    path = str(tiny_qwen2_tied)
    rt = Runtime.load(path, path, config, offload=OffloadConfig(quant="int4", draft_quant="int4",
                                                                cache_dir=str(cache_root)))
    draft, target = rt.engine.draft.lm_head, rt.engine.target.lm_head
    assert draft.kernel() == "int4-cpu" and "int4 head" in rt.draft_info.dtype
    assert target.kernel() == "int8-cpu" and "int8 head" in rt.target_info.dtype
    alone = rt.variant(config, use_draft=False)
    assert ids_of(rt) == ids_of(alone)



def test_a_host_embedding_gathers_the_rows_a_device_lookup_would() -> None:
    """The CPU path: rows [..., dim] for ids of any shape, the same bits as the table indexed (a fresh tensor,
    not a view of a buffer the next pass writes)."""
    from specexec.runtime.offloaded import HostEmbedding

    table = torch.randn(50, 8)
    emb = HostEmbedding(table, torch.device("cpu"))
    ids = torch.tensor([[3, 7, 7], [0, 49, 1]])
    first = emb(ids)
    assert first.shape == (2, 3, 8) and torch.equal(first, table[ids])
    emb(torch.tensor([5, 6, 9, 11, 12, 13]))
    assert torch.equal(first, table[ids]) and emb.staging is None


@pytest.mark.gpu
def test_a_host_embedding_on_cuda_copies_from_a_pinned_staging_buffer_without_blocking() -> None:
    """On CUDA the rows go through one pinned staging buffer, grown to the largest pass and then reused (a
    non-blocking copy needs pinned memory); each pass's rows stay its own while later passes write the buffer."""
    from specexec.runtime.offloaded import HostEmbedding

    table = torch.randn(500, 64)
    emb = HostEmbedding(table, torch.device("cuda"))
    outs, ids = [], [torch.randint(0, 500, (n,), device="cuda") for n in (3, 40, 7, 200, 5)]
    for i in ids[:4]:
        outs.append(emb(i))
    buffer = emb.staging.data_ptr()
    outs.append(emb(ids[4]))
    assert emb.staging.is_pinned() and emb.staging.shape[0] >= 200 and emb.staging.data_ptr() == buffer
    for i, out in zip(ids, outs):
        assert out.is_cuda and torch.equal(out.cpu(), table[i.cpu()])
