"""Steps about the target's stream: a pass over the RAM tier against the link's pinned peak and the resident
layers' order (`ram-stream`), and the GPU memory a streamed run really holds against its ledger (`memory`).

Does not know: the draft (steps_draft.py).
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from tools.gpu_check.registry import Context, step

LINK_RATIO = 0.85                # a link-bound pass moves bytes at >= this share of the pinned peak


def _plan(arch: str, quant: str, layers: int, max_tokens: int, device: str, gpu_layers: float | None,
          offload: str, order: str = "planned"):
    """(bench stream's model args, layer bytes, plan) for synthetic `arch` layers, with a GPU budget of
    `gpu_layers` layers' bytes (None: what is free); order "prefix": the resident layers first, as before the
    planner spread them."""
    import torch

    from tools.gpu_check import project as P

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    args = P.synthetic_args(arch, layers)
    size = P.layer_layout(args, quant, dtype, dev).nbytes
    gpu_budget = None if gpu_layers is None else str(int(gpu_layers * size))
    ns = argparse.Namespace(gpu_budget=gpu_budget, ram_budget=P.RAM_BUDGET_TEXT, quant=quant, offload=offload)
    plan = P.make_plan(ns, args, size, dev, dtype, max_tokens)
    if order == "prefix":
        k = plan.tiers.count("resident")
        plan = replace(plan, tiers=("resident",) * k + tuple(t for t in plan.tiers if t != "resident"))
    return args, size, plan, dev, dtype


def _tiers(plan) -> str:
    return "".join("R" if t == "resident" else t[0] for t in plan.tiers)


def _bench(arch: str, quant: str, layers: int, tokens: list[int], device: str, offload: str) -> tuple[dict, list]:
    """bench stream's plan and rows (each pass starts cold: no read-ahead)."""
    from tools.gpu_check import project as P

    args, size, plan, dev, dtype = _plan(arch, quant, layers, max(tokens), device, None, offload)
    bench = P.StreamBench(args, plan, quant, dev, dtype, 1, None)
    try:
        rows = P.measure(bench, tokens)
    finally:
        bench.close()
    return {"tiers": _tiers(plan), "layer_bytes": size, "slots": plan.n_slots}, rows


def _pass_after_drafting(order: str, tokens: int = 128, reps: int = 3) -> dict:
    """GPU seconds of a 70B NF4 pass over 12 layers, about 4 of them resident, when the slots were filled
    beforehand (what the draft's time gives the engine: prefetch_start, then the loaders go idle)."""
    from tools.gpu_check import project as P

    args, size, plan, dev, dtype = _plan("70b", "nf4", 12, tokens, "cuda", 6.6, "auto", order)
    bench = P.StreamBench(args, plan, "nf4", dev, dtype, 1, None)
    try:
        pager = bench.model.pager
        bench.one_pass(1)                                            # warm-up
        times = []
        for _ in range(reps):
            pager.prefetch_start(range(args.n_layers))
            pager.wait_idle(60)
            times.append(bench.one_pass(tokens)["pass_s"])
    finally:
        bench.close()
    return {"tiers": _tiers(plan), "s": round(statistics.median(times), 5)}


@step("ram-stream", budget_s=30)
def ram_stream(ctx: Context) -> None:
    """bench stream over the RAM tier (the PCIe link): GB/s against the measured pinned peak, 70B NF4 and bf16
    layers; and a pass with resident layers spread among the streamed ones against all of them first."""
    if not ctx.cuda:
        plan, rows = _bench("1b", "int4", 2, [1], "cpu", "ram")
        ctx.figure("cpu_rows", rows)
        ctx.check("a CPU RAM-tier pass streams", rows[0]["effective_gbps"] > 0, rows[0]["effective_gbps"], "> 0")
        return
    for quant, layers, tokens in (("nf4", 10, [1, 256, 2048]), ("none", 6, [1, 512])):
        plan, rows = _bench("70b", quant, layers, tokens, "cuda", "ram")
        ctx.figure(f"70b_{quant}", {"plan": plan, "rows": rows})
        r = rows[0]
        ctx.check(f"70b {quant}: 1-token pass at the link's pinned peak", (r["ratio"] or 0) >= LINK_RATIO,
                  {"effective": r["effective_gbps"], "peak": r["tier_peak_gbps"], "ratio": r["ratio"]}, LINK_RATIO)
        ctx.check(f"70b {quant}: copy engine busy", r["copy_busy"] >= LINK_RATIO, r["copy_busy"], LINK_RATIO)
    passes = {order: _pass_after_drafting(order) for order in ("planned", "prefix")}
    ratio = round(passes["planned"]["s"] / passes["prefix"]["s"], 3)
    ctx.figure("resident_order", {**passes, "spread_over_prefix": ratio})
    ctx.check("a layer stayed resident beside the slots", "R" in passes["planned"]["tiers"],
              passes["planned"]["tiers"], "some R")
    ctx.check("resident layers spread: a pass no slower than with them first", ratio <= 1.02, ratio, 1.02)


class _Planned(Exception):
    """Raised from on_plan: the plan is all that was wanted."""


@step("memory", budget_s=20, cuda=True, why_cuda="the ledger's device side is GPU memory (the CPU's is RAM)")
def memory(ctx: Context) -> None:
    """Peak GPU memory of a streamed bf16 run (3 of 8 layers resident, a 128-node tree) against the ledger:
    allocated within its device total, reserved within the GPU budget it planned for."""
    import torch

    from tools.gpu_check import project as P

    target = P.write_model(ctx.tmp / "target", n_layers=8, hidden=768, n_heads=12, n_kv_heads=4, intermediate=2048)
    draft = P.write_model(ctx.tmp / "draft", n_layers=2, hidden=512, n_heads=8, n_kv_heads=2, intermediate=1408)
    config = P.EngineConfig(device="cuda", dtype="bfloat16", budget=128, max_new_tokens=64)
    seen = []

    def stop(plan) -> None:
        seen.append(plan)
        raise _Planned
    base = P.OffloadConfig(offload="ram", quant="none", context=2048, cache_dir=str(ctx.tmp / "cache"),
                           ram_budget=P.RAM_BUDGET)
    try:
        P.Runtime.load(str(target), str(draft), config, offload=base, on_plan=stop)
    except _Planned:
        pass
    p = seen[0].plan
    budget = p.device_bytes + int(3.5 * p.needs.layer_bytes[0])
    rt = P.Runtime.load(str(target), str(draft), config, offload=replace(base, offload="auto", gpu_budget=budget))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ids = [t for s in rt.generate_ids(P.prompt(3, 40), 64) for t in s]
    torch.cuda.synchronize()
    plan = rt.plan.plan
    peak_alloc, peak_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    ctx.figure("tiers", "".join("R" if t == "resident" else t[0] for t in plan.tiers))
    ctx.figure("ledger_device_bytes", plan.device_bytes)
    ctx.figure("gpu_budget", plan.gpu_budget)
    ctx.figure("peak_allocated", peak_alloc)
    ctx.figure("peak_reserved", peak_reserved)
    ctx.figure("allocated_over_ledger", round(peak_alloc / plan.device_bytes, 3))
    ctx.figure("reserved_over_ledger", round(peak_reserved / plan.device_bytes, 3))
    ctx.figure("ledger", plan.ledger()["device"])
    ctx.check("generated", len(ids) > 0, len(ids), "> 0")
    ctx.check("some layers resident, some streamed", 0 < plan.tiers.count("resident") < len(plan.tiers),
              ctx.figures["tiers"], "a mix")
    ctx.check("peak allocated within the ledger (+2 %)", peak_alloc <= 1.02 * plan.device_bytes,
              ctx.figures["allocated_over_ledger"], 1.02)
    ctx.check("peak reserved within the planned GPU budget", peak_reserved <= plan.gpu_budget, peak_reserved,
              plan.gpu_budget)
    rt.engine.close()
