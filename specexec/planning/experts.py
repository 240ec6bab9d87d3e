"""Planning a mixture-of-experts target from config.json: which bytes of a sparse layer one pass reads.

A sparse layer packs its dense part (norms, attention, router, a shared expert) and each routed expert as its
own region (sizes.expert_split). A streamed pass over N rows copies the dense part and only the experts its
rows were routed to: E[union] of them (specexec/tuning/routing.py: independent rows with N^gamma of them
effective; the prior, before a run has routed anything, is uniform routing with gamma PRIOR_GAMMA). The
planner (offload/planner.py, Needs.parts) prices a streamed sparse layer at dense + E[union] x expert bytes and
gives device memory left over to an expert cache: the c most often routed-to experts of each streamed sparse
layer stay on the device (under uniform routing any c alike; a run ranks them by its own routing counts).

`expert_parts` makes the planner's Parts for a run shape (rows: the tree pass, budget + 1); `moe_summary`
re-prices the same placement at other tree budgets (what `specexec plan` prints beside the ledger).

Does not know: how experts are copied or cached at run time (specexec/runtime/), trees, budgets' choice.
"""
from __future__ import annotations

from dataclasses import replace

from offload.memory_plan import Parts, Plan

from specexec.checkpoints.naming import sparse_layer
from specexec.config import ModelArgs
from specexec.planning.run_shape import RunShape
from specexec.planning.sizes import expert_split
from specexec.tuning.routing import PRIOR_GAMMA, uniform_union

SHOWN_BUDGETS = (0, 16, 64, 256)     # tree budgets `specexec plan` prices an MoE pass at (0: no draft)


def sparse_layers(args: ModelArgs) -> tuple[int, ...]:
    """The decoder layers with a routed feed-forward (empty for a dense model)."""
    return tuple(i for i in range(args.n_layers) if sparse_layer(args, i))


def expert_parts(shape: RunShape, fmt: str, rows: int | None = None, gamma: float = PRIOR_GAMMA) -> Parts | None:
    """The planner's Parts of an MoE target in `fmt`: its sparse layers, one expert's bytes, and the experts a
    pass of `rows` rows (default the tree pass: budget + 1) reads from a layer whose c hottest are cached, for
    c = 0 .. E (uniform routing, gamma). None for a dense target."""
    args, layers = shape.target, sparse_layers(shape.target)
    if args.moe is None or not layers:
        return None
    m = args.moe
    _, each = expert_split(args, fmt, shape.dtype, shape.device, layers[0])
    n = shape.budget + 1 if rows is None else rows
    reads = tuple(uniform_union(m.n_experts, m.top_k, n, gamma, c) for c in range(m.n_experts + 1))
    return Parts(layers, each, m.n_experts, reads, "expert")


def priced_at(plan: Plan, shape: RunShape, fmt: str, rows: int) -> Plan:
    """The same placement and expert cache with a pass of `rows` rows (its expected seconds follow)."""
    parts = expert_parts(shape, fmt, rows)
    return plan if parts is None else replace(plan, needs=replace(plan.needs, parts=parts))


def moe_summary(plan: Plan, shape: RunShape, fmt: str, budgets: tuple[int, ...] = SHOWN_BUDGETS) -> dict | None:
    """For --json and the text: the experts' shape and bytes, the cache, and per tree budget the expected
    distinct experts read per streamed sparse layer and seconds per pass. None for a dense target."""
    parts = plan.needs.parts
    if parts is None:
        return None
    m = shape.target.moe
    dense, each = expert_split(shape.target, fmt, shape.dtype, shape.device, parts.layers[0])
    at = {}
    for b in budgets:
        p = priced_at(plan, shape, fmt, b + 1)
        at[str(b)] = {"experts_read_per_layer": round(p.needs.parts.reads[min(plan.cached_parts, m.n_experts)], 2),
                      "seconds_per_pass": round(p.expected_s, 4)}
    return {"experts": m.n_experts, "top_k": m.top_k, "sparse_layers": len(parts.layers),
            "streamed_sparse_layers": plan.parts_streamed, "dense_bytes_per_layer": dense, "expert_bytes": each,
            "cached_experts_per_layer": plan.cached_parts, "expert_cache_bytes": plan.part_cache_bytes,
            "routing_prior": f"uniform, gamma {PRIOR_GAMMA}", "by_budget": at}


def describe_moe(summary: dict) -> str:
    """The lines `specexec plan` prints for an MoE target (from moe_summary)."""
    s = summary
    head = (f"MoE: {s['experts']} experts, top-{s['top_k']}, {s['sparse_layers']} sparse layers "
            f"({s['streamed_sparse_layers']} streamed); per layer a {s['dense_bytes_per_layer'] / 1e6:.1f} MB dense "
            f"part and {s['experts']} experts of {s['expert_bytes'] / 1e6:.2f} MB")
    if not s["streamed_sparse_layers"]:
        return head + "\n  every sparse layer is resident: a pass reads no expert from RAM or disk"
    lines = [head, f"  expert cache: {s['cached_experts_per_layer']} of {s['experts']} experts per streamed layer stay on "
             f"the device ({s['expert_cache_bytes'] / 1e9:.2f} GB; a run keeps the ones it routes to most)",
             f"  predicted per pass (routing prior: {s['routing_prior']}; a run learns its own):"]
    for b, row in s["by_budget"].items():
        lines.append(f"    budget {b:>4}: {row['experts_read_per_layer']:6.1f} experts read per streamed layer, "
                     f"{row['seconds_per_pass']:.3f} s")
    return "\n".join(lines)
