"""Mixtral: Mistral's decoder with a routed feed-forward of `num_local_experts` experts of intermediate_size,
softmax router, top `num_experts_per_tok`, the kept weights always renormalised. Checkpoints store every expert
on its own as block_sparse_moe.experts.N.{w1 (gate), w3 (up), w2 (down)} and the router as
block_sparse_moe.gate.

Does not know: the network (specexec/network/model.py, specexec/network/moe.py), how tensors are read.
"""
from __future__ import annotations

from typing import Any

from specexec.config import ModelArgs, MoEArgs
from specexec.families.common import base_fields, check_activation, n_experts, sliding_window
from specexec.families.weight_rules import Rule

# what this module's families add to Llama's maths, one line (the README's table, `specexec models`)
SUMMARY = ("Mistral's decoder with a routed feed-forward (softmax top-k, renormalised; "
           '`block_sparse_moe.experts.N.w1/w2/w3`)')
ARCHITECTURES = {"MixtralForCausalLM": "mixtral"}
WEIGHT_RULES = (
    Rule(r"mlp\.router\.weight", "block_sparse_moe.gate.weight"),
    Rule(r"mlp\.experts\.(\d+)\.gate_proj\.weight", r"block_sparse_moe.experts.\1.w1.weight"),
    Rule(r"mlp\.experts\.(\d+)\.up_proj\.weight", r"block_sparse_moe.experts.\1.w3.weight"),
    Rule(r"mlp\.experts\.(\d+)\.down_proj\.weight", r"block_sparse_moe.experts.\1.w2.weight"),
)


def model_args(family: str, cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a Mixtral config.json."""
    check_activation(cfg, family)
    moe = MoEArgs(n_experts=n_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
                  expert_dim=int(cfg["intermediate_size"]), norm_topk_prob=True)
    return ModelArgs(family=family, **base_fields(cfg), sliding_window=sliding_window(cfg, default_on=True),
                     moe=moe)
