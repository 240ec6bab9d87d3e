"""The MoE path on the device (`moe-stream`): a small Qwen3-MoE (4 layers, 16 experts, top-2, hidden 256), written
once, streamed from the pinned RAM tier in bf16 and NF4, experts moved one by one (specexec/runtime/
expert_stream.py): greedy equals the same format resident, a one-token pass moves at most 30 % of the experts'
bytes and a 16-node tree more (not all), and each pass's bytes per second against the measured pinned peak.
Per format two loads: resident, and streamed with the draft (its no-draft variant gives the one-token passes).

Does not know: the CPU path (tests/experts/test_expert_stream.py runs the same mechanism there).
"""
from __future__ import annotations

from tools.gpu_check.registry import Context, step

SHAPE = dict(n_layers=4, hidden=256, n_heads=4, n_kv_heads=2, intermediate=512, num_experts=16, num_experts_per_tok=2,
             moe_intermediate_size=256, norm_topk_prob=True, use_sliding_window=False, attention_bias=False,
             mlp_only_layers=[], decoder_sparse_step=1)
NEW = 12
TREE = 16


def _config(P, budget: int):
    return P.EngineConfig(device="cuda", dtype="bfloat16", budget=budget, max_new_tokens=NEW, expert_trim="off")


def _load(P, target, draft, quant: str, offload: str, cache):
    return P.Runtime.load(str(target), str(draft) if draft else None, _config(P, TREE if draft else 1),
                          offload=P.OffloadConfig(offload=offload, quant=quant, cache_dir=str(cache),
                                                  ram_budget=P.RAM_BUDGET))


def _run(P, rt) -> dict:
    """One greedy generation: its ids, stats.moe, and bytes per second: the bytes streamed per pass (the prefill
    included) over the mean verification pass time."""
    ids = [t for s in rt.generate_ids(P.prompt(3, 24), NEW) for t in s]
    stats = rt.stats()
    moe = stats.get("moe") or {}
    seconds = stats["target_ms"] / 1000
    per_pass = (stats.get("bytes_streamed") or 0) / max(stats.get("passes") or 1, 1)
    return {"ids": ids, "moe": moe, "tokens_per_step": stats["tokens_per_step"], "target_s": round(seconds, 5),
            "bytes_per_pass": int(per_pass), "gbps": round(per_pass / seconds / 1e9, 3) if seconds else None}


@step("moe-stream", budget_s=55, cuda=True, why_cuda="expert copies over PCIe against the pinned peak, and NF4 "
      "experts (bitsandbytes' CUDA kernels), mean nothing on a CPU; the suite runs the CPU path")
def moe_stream(ctx: Context) -> None:
    """A streamed MoE in bf16 and NF4 over the RAM tier: exact against resident, expert bytes per pass, GB/s
    per pass against the pinned peak."""
    import torch

    from offload.streaming.tiers import host_buffer, probe_copy
    from tools.gpu_check import project as P

    target = P.write_model(ctx.tmp / "moe", "qwen3_moe", **SHAPE)
    draft = P.write_perturbed(ctx.tmp / "draft", target, 0.02)
    src = host_buffer(256 << 20, pin=True)
    peak = probe_copy([src] * 4, torch.empty(256 << 20, dtype=torch.uint8, device="cuda")) / 1e9
    ctx.figure("pinned_peak_gbps", round(peak, 2))
    for quant in ("none", "nf4"):
        rt = _load(P, target, None, quant, "none", ctx.tmp / "cache")
        try:
            resident = _run(P, rt)
        finally:
            rt.engine.close()
        rt = _load(P, target, draft, quant, "ram", ctx.tmp / "cache")
        try:
            tree = _run(P, rt)
            one = _run(P, rt.variant(_config(P, 1), use_draft=False))
        finally:
            rt.engine.close()
        ctx.figure(quant, {k: {x: v for x, v in r.items() if x != "ids"} for k, r in
                           (("one_token", one), (f"tree_{TREE}", tree))})
        ctx.check(f"{quant}: streamed greedy equals resident", one["ids"] == resident["ids"], one["ids"][:8],
                  resident["ids"][:8])
        m1, mt = one["moe"], tree["moe"]
        share = m1["expert_bytes_per_pass"] / m1["expert_bytes_all"]
        ctx.check(f"{quant}: a one-token pass moves <= 30 % of the experts' bytes", share <= 0.30, round(share, 3),
                  0.30)
        ctx.check(f"{quant}: a {TREE}-node tree moves more, not all",
                  m1["expert_bytes_per_pass"] < mt["expert_bytes_per_pass"] < mt["expert_bytes_all"],
                  mt["expert_bytes_per_pass"], mt["expert_bytes_all"])
        ctx.figure(f"{quant}_gbps_over_peak", {k: round(r["gbps"] / peak, 3) if r["gbps"] else None
                                              for k, r in (("one_token", one), (f"tree_{TREE}", tree))})
