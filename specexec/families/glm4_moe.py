"""GLM-4.5, GLM-4.6 and GLM-4.7 (Glm4MoeForCausalLM): config.json -> ModelArgs.

A pre-norm decoder with q/k/v biases (attention_bias; o_proj never has one), per-head q/k RMSNorm where
use_qk_norm, partial rotary (partial_rotary_factor, 0.5 when the config leaves it out, as transformers), and
DeepSeek-V3's routed feed-forward (specexec/families/common.py): sigmoid scores with a correction bias,
group-limited top-k, routed_scaling_factor, one shared expert, the first first_k_dense_replace layers dense.
Its next-token-prediction layer (num_nextn_predict_layers, stored as layer num_hidden_layers) is skipped.

Checkpoints store every expert on its own (mlp.experts.N.{gate,up,down}_proj), the router as mlp.gate (weight,
e_score_correction_bias), the shared expert as mlp.shared_experts.

Does not know: the network (specexec/network/model.py, specexec/network/moe.py), how tensors are read.
"""
from __future__ import annotations

from typing import Any

from specexec.config import ModelArgs
from specexec.families.common import ROPE_KINDS, base_fields, check_activation
from specexec.families.common import grouped_sigmoid_moe, mtp_layers
from specexec.families.weight_rules import Rule

# what this module's families add to Llama's maths, one line (the README's table, `specexec models`)
SUMMARY = ('GLM-4.5, 4.5-Air, 4.6, 4.7: q/k/v biases, optional q/k norms, partial rotary; sigmoid router '
           'choosing by score + correction bias among the best expert groups, `routed_scaling_factor`, a shared '
           'expert, dense first layers; the next-token-prediction layer after the decoder is left unread')
ARCHITECTURES = {"Glm4MoeForCausalLM": "glm4_moe"}
WEIGHT_RULES = (
    Rule(r"mlp\.router\.weight", "mlp.gate.weight"),
    Rule(r"mlp\.router\.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
    Rule(r"mlp\.shared_expert\.(\w+)\.weight", r"mlp.shared_experts.\1.weight"),
)


def model_args(family: str, cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a GLM-4.5 / 4.6 / 4.7 config.json."""
    check_activation(cfg, family)
    fields = base_fields(cfg, ROPE_KINDS + ("yarn",))
    rope = cfg.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
    return ModelArgs(family=family, **fields, qkv_bias=bool(cfg.get("attention_bias", False)),
                     qk_norm=bool(cfg.get("use_qk_norm", False)), rope_dim=rotary_dims(fields["head_dim"], partial),
                     moe=grouped_sigmoid_moe(cfg), mtp_layers=mtp_layers(cfg))


def rotary_dims(head_dim: int, partial: float) -> int | None:
    """The rotary dimensions of a head for partial_rotary_factor `partial` (None: the whole head)."""
    return None if partial == 1.0 else int(head_dim * partial)
