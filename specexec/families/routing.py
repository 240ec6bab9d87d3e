"""config.json fields of the sigmoid-routed mixtures of experts (DeepSeek-V3's routing, which GLM-4.5+ and
Kimi-K2 share): n_routed_experts experts of moe_intermediate_size, num_experts_per_tok chosen per token by
sigmoid scores plus e_score_correction_bias, limited to the topk_group best of n_group groups, renormalised when
norm_topk_prob, scaled by routed_scaling_factor; n_shared_experts shared experts (one gated MLP of
n_shared_experts x moe_intermediate_size); the first first_k_dense_replace layers dense. Also the count of
next-token-prediction layers stored after the decoder (num_nextn_predict_layers), which the target skips.

Contradicting fields are refused with one line naming the config.json field (not MoEArgs' name for it).

Does not know: the network (specexec/network/moe.py), checkpoints' tensor names (each family's WEIGHT_RULES).
"""
from __future__ import annotations

from typing import Any

from specexec.config import MoEArgs
from specexec.options import ConfigError


def grouped_sigmoid_moe(cfg: dict[str, Any]) -> MoEArgs:
    """MoEArgs of a DeepSeek-V3-style config; ConfigError naming the field for contradicting routing fields."""
    experts = _count(cfg, "n_routed_experts", cfg.get("n_routed_experts") or cfg.get("num_local_experts"))
    top_k = _count(cfg, "num_experts_per_tok", cfg["num_experts_per_tok"])
    groups = _count(cfg, "n_group", cfg.get("n_group") or 1)
    topk_group = _count(cfg, "topk_group", cfg.get("topk_group") or 1)
    layers = int(cfg["num_hidden_layers"])
    dense = int(cfg.get("first_k_dense_replace") or 0)
    if topk_group > groups:
        raise ConfigError(f"config.json's topk_group {topk_group} is above n_group {groups}: a token cannot use "
                          "more expert groups than there are")
    if experts % groups:
        raise ConfigError(f"config.json's n_routed_experts {experts} does not split into n_group {groups} equal groups")
    if top_k > experts // groups * topk_group:
        raise ConfigError(f"config.json's num_experts_per_tok {top_k} is above the {experts // groups * topk_group} "
                          f"experts a token may reach (n_routed_experts {experts} in n_group {groups}, topk_group "
                          f"{topk_group})")
    if groups > 1 and experts // groups < 2:
        raise ConfigError(f"config.json's n_group {groups} leaves {experts // groups} expert per group; a group "
                          "is scored by its two best experts")
    if not 0 <= dense <= layers:
        raise ConfigError(f"config.json's first_k_dense_replace {dense} is not within the {layers} layers")
    method = cfg.get("topk_method", "noaux_tc")
    scoring = cfg.get("scoring_func", "sigmoid")
    if method != "noaux_tc" or scoring != "sigmoid":
        raise ConfigError(f"config.json's routing (topk_method {method!r}, scoring_func {scoring!r}) is not the "
                          "sigmoid noaux_tc routing this family runs")
    shared = int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"])
    return MoEArgs(n_experts=experts, top_k=top_k, expert_dim=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), router="sigmoid", score_bias=True,
                   n_group=groups, topk_group=topk_group,
                   routed_scale=float(cfg.get("routed_scaling_factor") or 1.0), router_fp32=True,
                   shared_dim=shared, dense_layers=tuple(range(dense)))


def mtp_layers(cfg: dict[str, Any]) -> int:
    """Next-token-prediction layers stored after the last decoder layer (num_nextn_predict_layers, transformers'
    num_mtp_layers): the target never runs them; their tensors are left unread."""
    return int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers")) or 0)


def _count(cfg: dict[str, Any], name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json's {name} must be a positive integer, got {value!r}")
    return value
