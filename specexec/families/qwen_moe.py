"""The Qwen mixtures of experts: Qwen3-MoE (Qwen3's decoder: per-head q/k RMSNorm) and Qwen2-MoE / Qwen1.5-MoE
(Qwen2's decoder: q/k/v biases; plus a shared expert of shared_expert_intermediate_size that every token runs,
scaled by sigmoid of a [1, D] gate). Both route with a softmax over `num_experts`, keep the top
`num_experts_per_tok` (renormalised when `norm_topk_prob`), and have dense MLP layers where `mlp_only_layers`
or `decoder_sparse_step` say. Checkpoints store every expert on its own (mlp.experts.N.{gate,up,down}_proj),
the router as mlp.gate, the shared expert as mlp.shared_expert(_gate).

Does not know: the network (specexec/network/model.py, specexec/network/moe.py), how tensors are read.
"""
from __future__ import annotations

from typing import Any

from specexec.config import ModelArgs, MoEArgs
from specexec.families.common import base_fields, check_activation, layer_types, n_experts, sliding_window
from specexec.families.weight_rules import Rule

# what this module's families add to Llama's maths, one line (the README's table, `specexec models`)
SUMMARY = ('a routed feed-forward (softmax top-k, renormalised or not), dense layers by `mlp_only_layers` / '
           "`decoder_sparse_step`; Qwen2-MoE's shared expert behind its sigmoid gate")
ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe"}
WEIGHT_RULES = (Rule(r"mlp\.router\.weight", "mlp.gate.weight"),)


def dense_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    """Decoder layers with a dense MLP: those in mlp_only_layers, and every layer i with (i + 1) not a multiple
    of decoder_sparse_step."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    return tuple(i for i in range(int(cfg["num_hidden_layers"])) if i in only or (i + 1) % step)


def model_args(family: str, cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a Qwen3-MoE or Qwen2-MoE config.json (a config with num_experts 0 is the dense decoder)."""
    check_activation(cfg, family)
    count, qwen2 = n_experts(cfg), family == "qwen2_moe"
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if qwen2 else 0
    moe = None if not count else MoEArgs(
        n_experts=count, top_k=int(cfg["num_experts_per_tok"]), expert_dim=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense_layers(cfg),
        shared_dim=shared, shared_gate=bool(shared))
    window = sliding_window(cfg, default_on=False)
    types: tuple[str, ...] = ()
    if window and qwen2:                    # transformers: odd layers below max_window_layers slide
        first_full = int(cfg.get("max_window_layers", 0))
        types = layer_types(cfg, lambda i: "sliding_attention" if (i + 1) % 2 and i < first_full else "full_attention")
    bias = bool(cfg.get("attention_bias", False))
    return ModelArgs(family=family, **base_fields(cfg), qkv_bias=bool(cfg.get("qkv_bias", True)) if qwen2 else bias,
                     o_bias=False if qwen2 else bias, qk_norm=not qwen2, sliding_window=window, layer_types=types,
                     moe=moe)
