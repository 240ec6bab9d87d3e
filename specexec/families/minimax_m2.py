"""MiniMax-M2 (MiniMaxM2ForCausalLM): config.json -> ModelArgs.

A pre-norm decoder without biases whose q/k RMSNorms run over the whole q and k projections (not per head,
like OLMoE's), partial rotary (rotary_dim of head_dim, or partial_rotary_factor), and a routed feed-forward of
num_local_experts experts of intermediate_size: sigmoid scores, the top num_experts_per_tok chosen by score plus
e_score_correction_bias, the kept sigmoid weights renormalised. No shared expert, no dense layers. Every layer
attends fully; a config listing lightning (linear) attention layers in attn_type_list is MiniMax-01's hybrid,
refused.

Checkpoints store the feed-forward Mixtral's way: block_sparse_moe.experts.N.{w1 (gate), w3 (up), w2 (down)},
block_sparse_moe.gate (the router) and block_sparse_moe.e_score_correction_bias.

Does not know: the network (specexec/network/model.py, specexec/network/moe.py), how tensors are read.
"""
from __future__ import annotations

from typing import Any

from specexec.config import ModelArgs, MoEArgs
from specexec.families.common import base_fields, check_activation, n_experts
from specexec.families.glm4_moe import rotary_dims
from specexec.families.weight_rules import Rule
from specexec.options import ConfigError

# what this module's families add to Llama's maths, one line (the README's table, `specexec models`)
SUMMARY = ('q/k norms over the whole projection, partial rotary (`rotary_dim`), sigmoid router choosing by score'
           " + correction bias (Mixtral's `block_sparse_moe` names)")
ARCHITECTURES = {"MiniMaxM2ForCausalLM": "minimax_m2"}
E = r"mlp\.experts\.(\d+)\."
WEIGHT_RULES = (
    Rule(r"mlp\.router\.weight", "block_sparse_moe.gate.weight"),
    Rule(r"mlp\.router\.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias"),
    Rule(E + r"gate_proj\.weight", r"block_sparse_moe.experts.\1.w1.weight"),
    Rule(E + r"up_proj\.weight", r"block_sparse_moe.experts.\1.w3.weight"),
    Rule(E + r"down_proj\.weight", r"block_sparse_moe.experts.\1.w2.weight"),
)


def model_args(family: str, cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a MiniMax-M2 config.json."""
    check_activation(cfg, family)
    kinds = cfg.get("attn_type_list")
    if kinds and any(int(k) != 1 for k in kinds):
        raise ConfigError("this MiniMax config lists lightning (linear) attention layers in attn_type_list "
                          "(MiniMax-01's hybrid); MiniMax-M2 attends fully in every layer, which is what runs here")
    fields = base_fields(cfg)
    fields["rope_theta"] = float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 5e6)))
    head_dim = fields["head_dim"]
    rope = cfg.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is None:
        partial = int(cfg.get("rotary_dim") or head_dim) / head_dim
    experts, top_k = n_experts(cfg), int(cfg["num_experts_per_tok"])
    if top_k > experts:
        raise ConfigError(f"config.json's num_experts_per_tok {top_k} is above num_local_experts {experts}")
    moe = MoEArgs(n_experts=experts, top_k=top_k, expert_dim=int(cfg["intermediate_size"]), norm_topk_prob=True,
                  router="sigmoid", score_bias=True)
    return ModelArgs(family=family, **fields, qk_norm=bool(cfg.get("use_qk_norm", True)), qk_norm_per_head=False,
                     rope_dim=rotary_dims(head_dim, float(partial)), moe=moe)
