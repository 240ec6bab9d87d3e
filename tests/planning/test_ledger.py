"""The memory ledger on cards we do not have, through `specexec plan` (the planner's harness): Llama-3.1-70B
NF4 with a Llama-3.1-8B draft on simulated 24 / 16 / 12 GB cards, from the real config.json files alone
(specexec/checkpoints/configs; no weight exists anywhere). Every byte is accounted: each ledger line is recomputed here by
hand from the config, the lines sum to what each budget holds, and the layers of the three tiers sum to the
model. The ledgers are printed into the test output. Also: a bf16 8B draft and a 12 GB card get one line that
says what would fit; the GPU budget of "this machine" comes from mem_get_info after empty_cache; read-ahead
depth; and the ledger's sizes equal those of real objects (layer cache layouts, a loaded quantized draft).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specexec.checkpoints.catalog import SHIPPED_CONFIGS
from cli.main import main
from offload.cache.store import plan as cache_plan
from offload.memory_plan import GB
from specexec.config import EngineConfig, OffloadConfig
from specexec.kv.cache import KVCache
from specexec.planning.ledger import CUDA_CONTEXT, card_budget, plan_memory
from specexec.planning.run_shape import RunShape
from specexec.planning.sizes import layer_bytes, weight_bytes
from specexec.checkpoints.loading import load_model, read_args
from specexec.checkpoints.naming import layer_names
from specexec.planning.sizes import module_bytes
from specexec.runtime.offloaded import quantize_head, quantize_layers
from specexec.runtime.assembly import Runtime

CONFIGS = SHIPPED_CONFIGS
T70, D8, Q32 = (CONFIGS / n for n in ("llama-3.1-70b-instruct", "llama-3.1-8b-instruct", "qwen2.5-32b-instruct"))
HEADLINE = ["--model", str(T70), "--draft", str(D8), "--quant", "nf4", "--draft-quant", "nf4", "--ram-budget", "64GB"]
V, D, L, I = 128256, 8192, 80, 28672          # Llama-3.1-70B
DD, DL, DI = 4096, 32, 14336                  # Llama-3.1-8B
BF16 = 2


def plan_cli(capsys, *flags: str) -> tuple[int, str, str]:
    code = main(["plan", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys, *flags: str) -> dict:
    code, out, err = plan_cli(capsys, *flags, "--json")
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1
    return json.loads(out)


def show(capsys, title: str, text: str) -> None:
    """Print a ledger into the test output (not captured)."""
    with capsys.disabled():
        print(f"\n--- {title}\n{text}")


def nf4_bytes(out_f: int, in_f: int) -> int:
    """One NF4 weight as QuantLinear holds it: 4-bit codes, an fp32 absmax per 64 values, the 16-entry code."""
    n = out_f * in_f
    return n // 2 + n // 64 * 4 + 16 * 4


def draft_8b_nf4() -> int:
    """Llama-3.1-8B with NF4 linears, by hand: embed + head + final norm + RoPE buffer, 32 layers."""
    kv = 8 * 128
    layer = (2 * nf4_bytes(DD, DD) + 2 * nf4_bytes(kv, DD) + 3 * nf4_bytes(DI, DD)) + 2 * DD * BF16
    return 2 * V * DD * BF16 + DD * BF16 + 64 * 4 + DL * layer


def check_every_byte(out: dict, budget: int, gpu_budget: int, ram_budget: int) -> None:
    """Each line recomputed by hand; the lines sum to the totals; the tiers sum to the model."""
    dev, host, ssd = out["by_tier"]["device"], out["by_tier"]["host"], out["by_tier"]["ssd"]
    assert out["ledger"] == {**dev, **host, **ssd}
    assert sum(dev.values()) == out["device_bytes"] <= gpu_budget == out["gpu_budget"]
    assert sum(host.values()) == out["host_bytes"] <= ram_budget == out["ram_budget"]
    assert out["ledger"]["target norm/head"] == V * D * BF16 + D * BF16 + 64 * 4
    embed = out["ledger"].get("target embed", out["ledger"].get("target embed (host RAM)"))
    assert embed == V * D * BF16 and ("target embed" in dev) != ("target embed (host RAM)" in host)
    assert out["ledger"]["draft weights"] == draft_8b_nf4()                    # counted once, from the config
    kv_layer = 2 * 8 * 128 * (4096 + budget + 1) * BF16                      # one layer's K and V, every slot
    kv_streamed = out["kv"]["streamed_layers"]
    assert out["kv"]["device_layers"] + kv_streamed == L
    assert out["ledger"]["target KV cache"] == out["kv"]["device_layers"] * kv_layer
    assert host.get("target KV cache (streamed)", 0) == kv_streamed * kv_layer == out["kv"]["streamed_bytes_per_pass"]
    tail = 2 * 8 * 128 * (budget + 1) * BF16                                 # the tree rows a streamed layer keeps
    assert dev.get("target KV cache stages", 0) == (2 * kv_layer + kv_streamed * tail if kv_streamed else 0)
    # slots: the context, processed nodes, the trash slot, the root
    assert out["ledger"]["draft KV cache"] == 2 * DL * 8 * 128 * (4096 + (2 * budget + 1) + 1 + 1) * BF16
    layer = layer_bytes(read_args(T70), "nf4", torch.bfloat16)
    assert 0.48 * GB < layer < 0.485 * GB                                     # 855.6M NF4 weights + norms
    n = {"resident": out["resident_layers"], **out["streamed_layers"]}
    assert sum(n.values()) == L
    assert dev["resident target layers"] == n["resident"] * layer
    assert host.get("RAM tier layers", 0) == n["ram"] * layer and ssd.get("SSD tier layers", 0) == n["ssd"] * layer
    assert dev["streaming slots"] == out["slots"] * layer and out["slots"] == 2
    assert 0 < dev["activations"] < 3 * GB
    assert out["predicted_seconds_per_pass"] == pytest.approx(
        (n["ram"] * layer + kv_streamed * kv_layer) / 25e9 + n["ssd"] * layer / 3e9, abs=1e-3)


@pytest.mark.parametrize("budget", [1024, 2048])
def test_70b_nf4_with_an_8b_nf4_draft_on_a_24gb_card(capsys, budget: int) -> None:
    flags = [*HEADLINE, "--gpu-memory", "24GB", "--budget", str(budget)]
    out = plan_json(capsys, *flags)
    check_every_byte(out, budget, card_budget(24 * 10**9), 64 * 10**9)
    assert out["resident_layers"] >= 10
    assert out["link_gbps"] == 25.0 and out["format"] == "nf4"
    assert out["embed_on_host"]            # the 2.1 GB table in RAM keeps 4 more layers on the GPU
    assert out["prefill_tokens"] >= 2000   # a 2,000-token prompt is one streamed pass
    code, text, _ = plan_cli(capsys, *flags)
    assert code == 0 and "draft weights" in text and "predicted" in text and "s per target pass" in text
    show(capsys, f"70B nf4 + 8B nf4, 24 GB card, budget {budget}", text)


@pytest.mark.parametrize("budget", [1024, 2048])
def test_the_same_on_a_16gb_card(capsys, budget: int) -> None:
    out = plan_json(capsys, *HEADLINE, "--gpu-memory", "16GB", "--budget", str(budget))
    check_every_byte(out, budget, card_budget(16 * 10**9), 64 * 10**9)
    assert out["streamed_layers"]["ram"] >= 78
    code, text, _ = plan_cli(capsys, *HEADLINE, "--gpu-memory", "16GB", "--budget", str(budget))
    show(capsys, f"70B nf4 + 8B nf4, 16 GB card, budget {budget}", text)


@pytest.mark.parametrize("budget", [1024, 2048])
def test_a_12gb_card_says_in_one_line_what_would_fit(capsys, budget: int) -> None:
    code, out, err = plan_cli(capsys, *HEADLINE, "--gpu-memory", "12GB", "--budget", str(budget))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("error: --gpu-memory 12GB leaves a 10.90 GB budget") and "a card of at least" in err
    assert "would fit (" in err and "draft weights (6.03 GB)" in err
    show(capsys, f"70B nf4 + 8B nf4, 12 GB card, budget {budget}", err.strip())


def test_a_bf16_8b_draft_gets_one_line_saying_what_would_fit(capsys) -> None:
    flags = ["--model", str(T70), "--draft", str(D8), "--quant", "nf4", "--ram-budget", "64GB",
             "--gpu-memory", "24GB", "--budget", "2048"]
    code, out, err = plan_cli(capsys, *flags)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "draft weights (16.06 GB)" in err and "--draft-quant nf4 would fit (" in err
    show(capsys, "70B nf4 + 8B bf16, 24 GB card", err.strip())


def test_this_machines_gpu_is_measured_after_empty_cache(capsys, monkeypatch) -> None:
    """Without --gpu-memory: mem_get_info of this GPU (faked: a 24 GB card, 0.5 GB taken by the context),
    read after torch.cuda.empty_cache(), minus the same margin -> the same plan as --gpu-memory 24GB."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    total = 24 * 10**9

    def mem_get_info(device=None):
        calls.append("mem_get_info")
        return total - CUDA_CONTEXT, total
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    here = plan_json(capsys, *HEADLINE, "--budget", "2048")
    assert calls[:2] == ["empty_cache", "mem_get_info"]
    card = plan_json(capsys, *HEADLINE, "--budget", "2048", "--gpu-memory", "24GB")
    assert here["gpu_budget"] == card["gpu_budget"] and here["resident_layers"] == card["resident_layers"]


def test_read_ahead_grows_into_ram_left_over_but_never_displaces_a_layer(capsys) -> None:
    forced = plan_json(capsys, *HEADLINE, "--gpu-memory", "24GB", "--offload", "ssd")
    assert forced["read_ahead"] == 8 and forced["ledger"]["SSD bounce buffers"] == 8 * layer_bytes(
        read_args(T70), "nf4", torch.bfloat16)
    tight = plan_json(capsys, *HEADLINE[:-1], "24GB", "--gpu-memory", "24GB")
    assert tight["streamed_layers"]["ssd"] > 0 and tight["read_ahead"] == 2        # RAM is full of RAM-tier layers
    cpu = plan_json(capsys, *HEADLINE[:-1], "48GB", "--device", "cpu", "--offload", "ssd")
    assert cpu["device"] == "cpu" and cpu["read_ahead"] == cpu["slots"] == 8


@pytest.mark.parametrize("config", [T70, D8, Q32])
def test_every_fixture_plans_from_its_config_alone(capsys, config: Path) -> None:
    out = plan_json(capsys, "--model", str(config), "--gpu-memory", "16GB", "--ram-budget", "64GB")
    assert sum([out["resident_layers"], *out["streamed_layers"].values()]) == read_args(config).n_layers
    assert out["device_bytes"] <= card_budget(16 * 10**9)


def test_plan_flag_errors_are_one_line(capsys, tmp_path: Path) -> None:
    for flags, message in ((["--model", str(tmp_path)], "has no config.json"),
                           ([*HEADLINE, "--gpu-memory", "lots"], "--gpu-memory: 'lots' is not a size"),
                           ([*HEADLINE, "--link-gbps", "0"], "--link-gbps must be in"),
                           ([*HEADLINE, "--quant", "q2"], "unknown --quant"),
                           ([*HEADLINE, "--gpu-memory", "1GB"], "leaves nothing")):
        code, _, err = plan_cli(capsys, *flags)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------------------------ real objects

@pytest.mark.parametrize("fmt", ["none", "nf4", "int8", "int4"])
def test_config_only_sizes_equal_the_real_objects(tiny_pair, fmt: str) -> None:
    """layer_bytes = the layer cache's layouts (from the checkpoint's headers); weight_bytes = a loaded,
    quantized model's parameters and buffers; kv_bytes = a KVCache's."""
    from specexec.planning.sizes import kv_bytes

    target, draft = tiny_pair
    args = read_args(target)
    layouts = cache_plan(target, layer_names(target, args), fmt, torch.float32, False)
    assert {lay.nbytes for lay in layouts} == {layer_bytes(args, fmt, torch.float32)}
    model = load_model(draft)
    quantize_layers(model, fmt)
    quantize_head(model, fmt)
    assert sum(weight_bytes(read_args(draft), fmt, torch.float32).values()) == module_bytes(model)
    a = read_args(draft)
    assert kv_bytes(a, 77, 4) == KVCache(a.n_layers, a.n_kv_heads, a.head_dim, 77, torch.float32, "cpu").nbytes


@pytest.mark.parametrize("fmt", ["none", "int8"])
def test_moe_sizes_equal_the_layer_cache_layouts(tiny_qwen3_moe, fmt: str) -> None:
    """An MoE target's per-layer bytes and its dense / per-expert split (planning, from config.json) are the
    layer cache's layouts from the checkpoint's headers: each expert a region of one size."""
    from specexec.planning.sizes import expert_split, layer_sizes

    args = read_args(tiny_qwen3_moe)
    layouts = cache_plan(tiny_qwen3_moe, layer_names(tiny_qwen3_moe, args), fmt, torch.float32, False)
    assert [lay.nbytes for lay in layouts] == list(layer_sizes(args, fmt, torch.float32))
    for i, lay in enumerate(layouts):
        dense, expert = expert_split(args, fmt, torch.float32, "cpu", i)
        assert dense == lay.dense_nbytes and {r.nbytes for r in lay.regions} == ({expert} if expert else set())
        assert dense + args.moe.n_experts * expert == lay.nbytes if expert else dense == lay.nbytes


def test_runtime_plans_before_loading_and_counts_the_draft_once(tiny_pair, tmp_path, monkeypatch) -> None:
    """The plan is made (and shown) before any weight loads; its draft line equals the loaded draft's bytes."""
    import specexec.runtime.loaders as loaders

    events: list[str] = []
    real_load = loaders.load_model
    monkeypatch.setattr(loaders, "load_model", lambda *a, **k: events.append("load") or real_load(*a, **k))
    rt = Runtime.load(str(tiny_pair[0]), str(tiny_pair[1]), EngineConfig(budget=8),
                      offload=OffloadConfig(offload="ssd", draft_quant="nf4", cache_dir=str(tmp_path)),
                      on_plan=lambda plan: events.append("plan"))
    try:
        assert events[0] == "plan" and "load" in events
        ledger = rt.plan.memory.ledger()
        assert ledger["draft weights"] == module_bytes(rt.engine.draft)
        t_slots, d_slots = rt.plan.memory.shape.slots
        assert rt.plan.memory.context == 512                      # the tiny models' maximum (< 4096)
        assert (t_slots, d_slots) == (512 + 9, 512 + 17 + 1 + 1)    # draft: processed nodes, trash slot, root
    finally:
        rt.engine.close()


def test_cpu_plan_of_a_streamed_target_keeps_the_embedding_in_ram(tiny_pair) -> None:
    """On a CPU the two placements cost the same; the host placement is taken so the CPU runs its code path."""
    shape = RunShape(read_args(tiny_pair[0]), None, torch.float32, "cpu", 8, 512)
    m = plan_memory(shape, ("nf4",), ram=10**9, gpu=None, mode="ssd")
    assert m.embed_on_host and "target embed (host RAM)" in m.ledger() and m.prefill_tokens == 512
    resident = plan_memory(shape, ("none",), ram=10**9, gpu=None, mode="none")
    assert not resident.embed_on_host and "target embed" in resident.ledger()


# ------------------------------------------------------------------------------------------------ long context

LONG = [*HEADLINE, "--gpu-memory", "24GB"]


def test_long_context_plans_with_kv_that_streams_with_its_layer(capsys) -> None:
    """70B NF4 + 8B NF4 draft on a 24 GB card at 4k / 32k / 128k context: every context plans (128k too, with
    the target's KV streamed from RAM), every byte accounted, and 32k costs at most 1.5x the 4k pass."""
    plans = {c: plan_json(capsys, *LONG, "--context", str(c)) for c in (4096, 32768, 131072)}
    for c, out in plans.items():
        assert out["context"] == c and out["device_bytes"] <= out["gpu_budget"] and out["host_bytes"] <= 64e9
        assert out["ledger"]["target KV cache"] + out["ledger"].get("target KV cache (streamed)", 0) == \
            L * 2 * 8 * 128 * (c + 65) * BF16                           # every layer's KV, once, somewhere
        assert not out["kv"]["lossy"] and out["kv"]["quant"] == "none"
    assert plans[4096]["kv"]["streamed_layers"] == 0                   # it fits: nothing moves that need not
    assert plans[32768]["kv"]["streamed_layers"] > 0
    assert plans[131072]["kv"]["streamed_layers"] > 0 and plans[131072]["kv"]["streamed_bytes_per_pass"] > 30e9
    assert plans[131072]["kv"]["draft_quant"] == "int8"                # the draft's own 17 GB cache, to fit
    assert plans[32768]["predicted_seconds_per_pass"] <= 1.5 * plans[4096]["predicted_seconds_per_pass"]
    for c in plans:
        code, text, _ = plan_cli(capsys, *LONG, "--context", str(c))
        assert code == 0
        show(capsys, f"70B nf4 + 8B nf4, 24 GB card, context {c}", text)
    assert "target KV cache streamed with" in text and "of KV cache" in text


def test_the_128k_kv_streams_from_pinned_ram_and_its_bytes_are_in_the_pass_time(capsys) -> None:
    out = plan_json(capsys, *LONG, "--context", "131072")
    n = {"resident": out["resident_layers"], **out["streamed_layers"]}
    kv_layer = 2 * 8 * 128 * (131072 + 65) * BF16
    layer = layer_bytes(read_args(T70), "nf4", torch.bfloat16)
    assert out["kv"]["streamed_bytes_per_pass"] == out["kv"]["streamed_layers"] * kv_layer
    assert out["predicted_seconds_per_pass"] == pytest.approx(
        (n["ram"] * layer + out["kv"]["streamed_bytes_per_pass"]) / 25e9 + n["ssd"] * layer / 3e9, abs=1e-3)
    assert out["ledger"]["target KV cache stages"] >= 2 * kv_layer


def test_kv_quant_int8_is_lossy_and_counts_its_smaller_bytes(capsys) -> None:
    exact = plan_json(capsys, *LONG, "--context", "32768")
    lossy = plan_json(capsys, *LONG, "--context", "32768", "--kv-quant", "int8")
    assert lossy["kv"] == {**lossy["kv"], "quant": "int8", "lossy": True}
    total = {o["kv"]["quant"]: o["ledger"]["target KV cache"] + o["ledger"].get("target KV cache (streamed)", 0)
             for o in (exact, lossy)}
    assert total["none"] == L * 2 * 8 * 128 * (32768 + 65) * BF16
    assert total["int8"] == L * 2 * 8 * (128 + 4) * (32768 + 65)          # 1 byte per value + a fp32 scale per row
    assert lossy["predicted_seconds_per_pass"] < exact["predicted_seconds_per_pass"]
    code, text, _ = plan_cli(capsys, *LONG, "--context", "32768", "--kv-quant", "int8")
    assert code == 0 and "LOSSY" in text


def test_a_streamed_moe_target_is_priced_by_its_expected_expert_union(capsys, tiny_qwen3_moe) -> None:
    """`specexec plan` for an MoE target: a streamed sparse layer costs its dense part plus the experts a pass
    is expected to read (uniform prior), more at larger budgets but never all; the ledger's expert cache (when
    any) fits the budget; the text says so."""
    from specexec.planning.sizes import expert_split, layer_sizes

    args = read_args(tiny_qwen3_moe)
    dense, expert = expert_split(args, "int8", torch.float32, "cpu", 0)
    out = plan_json(capsys, "--model", str(tiny_qwen3_moe), "--device", "cpu", "--quant", "int8",
                    "--offload", "ssd", "--ram-budget", "64MB")
    moe = out["moe"]
    assert moe["experts"] == 16 and moe["top_k"] == 4 and moe["sparse_layers"] == 2      # layer 1 is dense
    assert moe["dense_bytes_per_layer"] == dense and moe["expert_bytes"] == expert
    by = moe["by_budget"]
    reads = [by[b]["experts_read_per_layer"] for b in ("0", "16", "64", "256")]
    seconds = [by[b]["seconds_per_pass"] for b in ("0", "16", "64", "256")]
    assert reads[0] == pytest.approx(4.0, abs=0.01) and reads == sorted(reads) and reads[1] < 16
    assert seconds == sorted(seconds) and seconds[0] < seconds[-1]
    every = sum(layer_sizes(args, "int8", torch.float32)) / 1.5e9          # what reading whole layers would cost
    at64 = out["predicted_seconds_per_pass"]
    assert at64 == pytest.approx(by["64"]["seconds_per_pass"], abs=1e-4) and at64 < every
    code, text, _ = plan_cli(capsys, "--model", str(tiny_qwen3_moe), "--device", "cpu", "--quant", "int8",
                             "--offload", "ssd", "--ram-budget", "64MB")
    assert code == 0 and "MoE: 16 experts, top-4" in text and "budget   16:" in text


def test_a_captured_draft_has_a_ledger_line_for_its_graphs(tiny_pair, tiny_qwen3_moe) -> None:
    """On CUDA a draft whose passes are captured (builders/draft_graphs.py) counts its side stream's cuBLAS
    workspace and the graph pool (about one draft pass); a CPU run, or a draft that is never captured (MoE),
    has no such line."""
    from specexec.planning.needs import CUBLAS_WORKSPACE, needs_for

    target, draft = read_args(tiny_pair[0]), read_args(tiny_pair[1])
    cuda = dict(needs_for(RunShape(target, draft, torch.float16, "cuda", 64, 512), "none").fixed_bytes)
    assert CUBLAS_WORKSPACE < cuda["draft graphs"] < CUBLAS_WORKSPACE + cuda["activations"]
    cpu = dict(needs_for(RunShape(target, draft, torch.float32, "cpu", 64, 512), "none").fixed_bytes)
    assert "draft graphs" not in cpu
    moe = read_args(tiny_qwen3_moe)
    assert "draft graphs" not in dict(needs_for(RunShape(moe, moe, torch.float16, "cuda", 64, 512), "none").fixed_bytes)
