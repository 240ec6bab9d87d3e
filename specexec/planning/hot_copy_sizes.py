"""Sizing the self-draft of a mixture-of-experts target: its copies of the target's streamed sparse layers hold
the layer's dense part (norms, attention, router, a shared expert) and only H hot experts, not all E.

A whole-layer low-bit copy of a big MoE's sparse layer is nearly the whole layer (the experts are ~95 % of it), so
a self-draft of gpt-oss-120b or Qwen3-235B could copy a few layers only. A copy with H = HOT_FACTOR x top-k
experts (capped at E) costs the dense part plus H experts, so the draft can run every layer; its router masks the
experts the copy does not hold (specexec/network/moe.Router.allowed). Which H experts: the runtime's business
(specexec/runtime/hot_experts.py ranks them by the target's routing counts).

`hot_per_layer` and `copy_bytes` are what the ledger (ledger.py, needs.draft_weights) counts for a self-draft's
copies; `hot_json` the fields `specexec plan --json` shows.

Does not know: which experts are hot (a run's routing), how copies are read or bound, the planner's tiers.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specexec.checkpoints.naming import sparse_layer
from specexec.config import ModelArgs
from specexec.planning.sizes import expert_split, layer_bytes

HOT_FACTOR = 2            # a copy of a sparse layer holds HOT_FACTOR x top-k experts (at most all of them)


def hot_per_layer(args: ModelArgs) -> int:
    """H: the experts a self-draft's copy of one of `args`' sparse layers holds (0 for a dense model)."""
    if args.moe is None:
        return 0
    return min(args.moe.n_experts, HOT_FACTOR * args.moe.top_k)


def copy_bytes(args: ModelArgs, fmt: str, dtype: torch.dtype, device: str, layer: int) -> int:
    """Bytes of a self-draft's resident copy of decoder layer `layer` in `fmt`: the whole packed layer for a dense
    layer, the dense part and H experts (each its own aligned region, as packed) for a sparse one."""
    if not sparse_layer(args, layer):
        return layer_bytes(args, fmt, dtype, device, layer)
    dense, each = expert_split(args, fmt, dtype, device, layer)
    return dense + hot_per_layer(args) * each


def hot_json(args: ModelArgs, fmt: str, dtype: torch.dtype, device: str, copies: Sequence[int]) -> dict:
    """hot_experts_per_layer (H; 0 for a dense target) and hot_expert_bytes (the experts' bytes over every
    copied sparse layer) of a self-draft's `copies`."""
    sparse = [i for i in copies if sparse_layer(args, i)]
    h = hot_per_layer(args)
    each = expert_split(args, fmt, dtype, device, sparse[0])[1] if sparse else 0
    return {"hot_experts_per_layer": h, "hot_expert_bytes": len(sparse) * h * each, "hot_layers": len(sparse)}
