"""gpt-oss: a decoder with q/k/v/o biases, attention sinks (one learned logit per head in every softmax),
sliding and full attention layers alternating (layer_types), YaRN RoPE, and a routed feed-forward: a router
with a bias whose top `num_experts_per_tok` logits are softmaxed, experts with biases and a clamped gated
activation (swiglu_alpha, swiglu_limit).

Checkpoints store the experts fused, per layer: mlp.experts.gate_up_proj [E, D, 2I] (x @ W layout, gate and up
columns interleaved: gate = 0::2, up = 1::2), gate_up_proj_bias [E, 2I], down_proj [E, I, D], down_proj_bias
[E, D]; WEIGHT_RULES cut each of our per-expert tensors out of them. The Hub's MXFP4 checkpoints store
gate_up_proj/down_proj as _blocks/_scales pairs, which offload/formats/mxfp4.py reads as these same dense
tensors.

Does not know: the network (specexec/network/model.py, specexec/network/moe.py, specexec/network/attention.py), how tensors are read.
"""
from __future__ import annotations

from typing import Any

from specexec.config import ModelArgs, MoEArgs
from specexec.families.common import ROPE_KINDS, base_fields, layer_types, n_experts
from specexec.families.weight_rules import Rule

# what this module's families add to Llama's maths, one line (the README's table, `specexec models`)
SUMMARY = ('attention sinks, sliding / full layers, YaRN RoPE, biases, top-k-then-softmax router, clamped gated '
           'activation, fused experts (MXFP4 read exactly)')
ARCHITECTURES = {"GptOssForCausalLM": "gpt_oss"}
E = r"mlp\.experts\.(\d+)\."
WEIGHT_RULES = (
    Rule(E + r"gate_proj\.weight", "mlp.experts.gate_up_proj", expert=True, start=0, step=2, transpose=True),
    Rule(E + r"up_proj\.weight", "mlp.experts.gate_up_proj", expert=True, start=1, step=2, transpose=True),
    Rule(E + r"down_proj\.weight", "mlp.experts.down_proj", expert=True, transpose=True),
    Rule(E + r"gate_proj\.bias", "mlp.experts.gate_up_proj_bias", expert=True, start=0, step=2),
    Rule(E + r"up_proj\.bias", "mlp.experts.gate_up_proj_bias", expert=True, start=1, step=2),
    Rule(E + r"down_proj\.bias", "mlp.experts.down_proj_bias", expert=True),
)


def model_args(family: str, cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a gpt-oss config.json."""
    moe = MoEArgs(n_experts=n_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
                  expert_dim=int(cfg["intermediate_size"]), router="topk_softmax", router_bias=True,
                  expert_bias=True, activation="clamped_swiglu", swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                  swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    bias = bool(cfg.get("attention_bias", True))
    window = cfg.get("sliding_window")
    return ModelArgs(family=family, **base_fields(cfg, ROPE_KINDS + ("yarn",)), qkv_bias=bias, o_bias=bias,
                     attention_sinks=True, sliding_window=int(window) if window else None,
                     layer_types=layer_types(cfg), moe=moe)
