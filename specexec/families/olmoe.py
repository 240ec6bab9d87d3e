"""OLMoE: a Llama-style decoder whose q/k RMSNorms run over the whole q and k projections (not per head),
with q, k and v optionally clamped to +-clip_qkv after them, and a routed feed-forward of `num_experts` experts
of intermediate_size: softmax router, top `num_experts_per_tok`, `norm_topk_prob` (default off). Checkpoints
store every expert on its own (mlp.experts.N.{gate,up,down}_proj), the router as mlp.gate.

Does not know: the network (specexec/network/model.py, specexec/network/moe.py), how tensors are read.
"""
from __future__ import annotations

from typing import Any

from specexec.config import ModelArgs, MoEArgs
from specexec.families.common import base_fields, check_activation, n_experts
from specexec.families.weight_rules import Rule

# what this module's families add to Llama's maths, one line (the README's table, `specexec models`)
SUMMARY = 'a routed feed-forward; q/k norms over the whole projection and `clip_qkv`'
ARCHITECTURES = {"OlmoeForCausalLM": "olmoe"}
WEIGHT_RULES = (Rule(r"mlp\.router\.weight", "mlp.gate.weight"),)


def model_args(family: str, cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of an OLMoE config.json."""
    check_activation(cfg, family)
    moe = MoEArgs(n_experts=n_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
                  expert_dim=int(cfg["intermediate_size"]), norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    bias = bool(cfg.get("attention_bias", False))
    clip = cfg.get("clip_qkv")
    return ModelArgs(family=family, **base_fields(cfg), qkv_bias=bias, o_bias=bias, qk_norm=True,
                     qk_norm_per_head=False, clip_qkv=float(clip) if clip is not None else None, moe=moe)
