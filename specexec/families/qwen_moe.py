"""Qwen3-MoE: Qwen3's decoder (per-head q/k RMSNorm) with a routed feed-forward: softmax router over
`num_experts`, top `num_experts_per_tok`, `norm_topk_prob`; dense MLP layers where `mlp_only_layers` or
`decoder_sparse_step` say. Checkpoints store every expert on its own (mlp.experts.N.{gate,up,down}_proj), the
router as mlp.gate.

Does not know: the network (specexec/model.py, specexec/moe.py), how tensors are read.
"""
from __future__ import annotations

from typing import Any

from specexec.config import ModelArgs, MoEArgs
from specexec.families.common import base_fields, check_activation, n_experts, sliding_window
from specexec.families.weights import Rule

ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe"}
WEIGHT_RULES = (Rule(r"mlp\.router\.weight", "mlp.gate.weight"),)


def dense_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """Decoder layers with a dense MLP: those in mlp_only_layers, and every layer i with (i + 1) not a multiple
    of decoder_sparse_step."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    return tuple(i for i in range(int(cfg["num_hidden_layers"])) if i in only or (i + 1) % step)


def model_args(family: str, cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a Qwen3-MoE config.json (a config with num_experts 0 is the dense decoder)."""
    check_activation(cfg, family)
    count = n_experts(cfg)
    moe = None if not count else MoEArgs(
        n_experts=count, top_k=int(cfg["num_experts_per_tok"]), expert_dim=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense_layers(cfg))
    bias = bool(cfg.get("attention_bias", False))
    return ModelArgs(family=family, **base_fields(cfg), qkv_bias=bias, o_bias=bias, qk_norm=True,
                     sliding_window=sliding_window(cfg, default_on=False), moe=moe)
