"""DeepSeek-V3, R1, V3.1 and Kimi-K2 (DeepseekV3ForCausalLM): config.json -> ModelArgs.

Every layer's token mixer is multi-head latent attention ("latent_attention": LatentArgs from kv_lora_rank,
q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_interleave), its cache one row of
kv_lora_rank + qk_rope_head_dim values (ModelArgs.head_dim, one KV head). RoPE over the qk_rope_head_dim
rotary part only, YaRN where the config says, and the score scale (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
times YaRN's mscale(factor, mscale_all_dim) squared (transformers' yarn_apply_mscale). The feed-forward is the
grouped sigmoid routing of specexec/families/common.py, shared experts, first_k_dense_replace dense layers;
the next-token-prediction layer stored after the decoder is skipped. attention_bias puts biases on q_a_proj,
kv_a_proj_with_mqa and o_proj (transformers' choice).

Refused with one line naming the attention kind (specexec/families/common.py SPARSE_ATTENTION): DeepSeek-V3.2
and GLM-5 (DeepSeek sparse attention: a lightning indexer picks 2,048 keys per query) and DeepSeek-V4
(compressed sparse attention), whose attention specexec does not compute.

Does not know: the network (specexec/network/latent.py, specexec/network/moe.py), how tensors are read.
"""
from __future__ import annotations

import math
from typing import Any

from specexec.config import LatentArgs, ModelArgs
from specexec.families.common import ROPE_KINDS, base_fields, check_activation
from specexec.families.glm4_moe import WEIGHT_RULES as GLM_RULES
from specexec.families.common import grouped_sigmoid_moe, mtp_layers

# what this module's families add to Llama's maths, one line (the README's table, `specexec models`)
SUMMARY = ('DeepSeek-V3, R1, V3.1; Kimi-K2: multi-head latent attention (low-rank q; the cache holds one latent '
           'row per token, kv_lora_rank + qk_rope_head_dim values: 70 KB a token for the 671B in bf16 against 5.0 MB '
           'as plain attention; interleaved RoPE on the decoupled part; YaRN with its score scale); GLM\'s routing '
           '(groups of experts); the next-token-prediction layer left unread. DeepSeek-V3.2 and GLM-5 (sparse '
           'attention with an indexer) and DeepSeek-V4 (compressed sparse attention) are refused naming their '
           'attention')
ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3"}
WEIGHT_RULES = GLM_RULES                       # mlp.gate (+ e_score_correction_bias), mlp.shared_experts


def model_args(family: str, cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a DeepSeek-V3 / Kimi-K2 config.json."""
    check_activation(cfg, family)
    q_rank = cfg.get("q_lora_rank")
    latent = LatentArgs(kv_rank=int(cfg["kv_lora_rank"]), rope_dim=int(cfg["qk_rope_head_dim"]),
                        nope_dim=int(cfg["qk_nope_head_dim"]), v_dim=int(cfg["v_head_dim"]),
                        q_rank=int(q_rank) if q_rank else None, interleaved=bool(cfg.get("rope_interleave", True)))
    fields = base_fields(cfg, ROPE_KINDS + ("yarn",))
    fields.update(n_kv_heads=1, head_dim=latent.kv_rank + latent.rope_dim)
    bias = bool(cfg.get("attention_bias", False))
    n = fields["n_layers"]
    return ModelArgs(family=family, **fields, qkv_bias=bias, o_bias=bias, rope_dim=latent.rope_dim,
                     attn_scale=score_scale(latent, dict(fields["rope_scaling"] or ()), fields),
                     layer_types=("latent_attention",) * n, latent=latent, moe=grouped_sigmoid_moe(cfg),
                     mtp_layers=mtp_layers(cfg))


def score_scale(latent: LatentArgs, scaling: dict[str, Any], fields: dict[str, Any]) -> float:
    """(nope_dim + rope_dim) ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under a YaRN scaling that names
    mscale_all_dim."""
    scale = (latent.nope_dim + latent.rope_dim) ** -0.5
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default" or not scaling.get("mscale_all_dim"):
        return scale
    factor = float(scaling.get("factor") or
                   fields["max_position_embeddings"] / scaling["original_max_position_embeddings"])
    m = 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
    return scale * m * m
