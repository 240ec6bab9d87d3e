"""The Qwen hybrids: Qwen3-Next (qwen3_next) and Qwen3.5 dense and MoE (qwen3_5, qwen3_5_moe; their
*ForConditionalGeneration checkpoints run the text decoder only, as for Gemma 3), one decoder:

- layer_types: Gated DeltaNet layers (linear_attention) with a gated full-attention layer every
  `full_attention_interval` layers (default 4) where the config lists no layer_types;
- the linear layers' shape (LinearArgs): linear_num_key_heads / linear_num_value_heads of linear_key_head_dim /
  linear_value_head_dim, a convolution of linear_conv_kernel_dim taps; Qwen3-Next stores the input projections
  as in_proj_qkvz and in_proj_ba grouped per key head, Qwen3.5 as in_proj_qkv, in_proj_z, in_proj_b, in_proj_a;
- the full-attention layers: q_proj carries a per-head output gate, per-head q/k RMSNorm, partial rotary
  (partial_rotary_factor, default 0.25; Qwen3.5's interleaved multimodal RoPE is plain RoPE for text, whose three
  position ids are equal);
- every RMSNorm scales by (1 + weight) except the linear layers' gated output norm;
- the MoE ones: a softmax router over num_experts keeping num_experts_per_tok (renormalised: always for
  Qwen3.5-MoE, norm_topk_prob for Qwen3-Next), plus a shared expert of shared_expert_intermediate_size behind a
  sigmoid gate; Qwen3-Next has dense layers where mlp_only_layers / decoder_sparse_step say, Qwen3.5-MoE none.

The multi-token-prediction layer the checkpoints carry (mtp.*: mtp_num_hidden_layers, ModelArgs.mtp_layers; only
--draft mtp reads it, specexec/drafters/mtp.py) and the vision tower (model.visual.*) are stored, never read by the
target (UNUSED).

Does not know: the network (specexec/network/linear_attention.py, self_attention.py, moe.py), tensors' data.
"""
from __future__ import annotations

from typing import Any

from specexec.config import LinearArgs, ModelArgs, MoEArgs
from specexec.families.common import base_fields, check_activation, layer_types, n_experts
from specexec.families.qwen_moe import dense_layers
from specexec.families.weight_rules import Rule

SUMMARY = ('hybrids: Gated DeltaNet linear-attention layers (a recurrent state, kept per tree branch: '
           'docs/algorithms.md §30) with a gated full-attention layer every 4 (`layer_types` / '
           '`full_attention_interval`), q_proj\'s output gate, q/k norms, partial rotary, (1 + w) norms; the MoE ones '
           'a routed feed-forward with a shared expert behind a sigmoid gate; the multimodal checkpoints run their '
           'text decoder; their MTP layer drafts with `--draft mtp`')
ARCHITECTURES = {
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
HYBRID = True                                  # its configs name linear-attention layers: run, not refused
WEIGHT_RULES = (Rule(r"mlp\.router\.weight", "mlp.gate.weight"),)
STORED_PREFIXES = {"model.language_model.": "", "language_model.model.": "language_model."}
UNUSED = (r"mtp\..*", r"(?:model\.)?visual\..*")
PARTIAL_ROTARY = 0.25                          # transformers' default for these families


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: a multimodal config's text_config (special ids and tie_word_embeddings from the top
    level where the text part leaves them out), or the config itself."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    inherited = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
                 if k in cfg and k not in text}
    return {**text, **inherited}


def model_args(family: str, cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a Qwen3-Next or Qwen3.5 (dense or MoE) config.json."""
    cfg = text_config(cfg)
    every = int(cfg.get("full_attention_interval") or 4)
    kinds = layer_types(cfg, lambda i: "full_attention" if (i + 1) % every == 0 else "linear_attention")
    check_activation(cfg, family)
    moe = _moe(family, cfg)
    if moe is not None and "intermediate_size" not in cfg:    # Qwen3.5-MoE: no dense MLP at all
        cfg = {**cfg, "intermediate_size": moe.expert_dim}
    fields = base_fields(cfg)
    rope = cfg.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", PARTIAL_ROTARY)))
    linear = LinearArgs(k_heads=int(cfg["linear_num_key_heads"]), v_heads=int(cfg["linear_num_value_heads"]),
                        k_dim=int(cfg["linear_key_head_dim"]), v_dim=int(cfg["linear_value_head_dim"]),
                        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
                        layout="qkvz" if family == "qwen3_next" else "split")
    bias = bool(cfg.get("attention_bias", False))
    return ModelArgs(family=family, **fields, qkv_bias=bias, o_bias=bias, qk_norm=True, norm_plus_one=True,
                     attn_output_gate=True, rope_dim=int(fields["head_dim"] * partial) if partial != 1.0 else None,
                     layer_types=kinds, linear=linear, moe=moe, mtp_layers=int(cfg.get("mtp_num_hidden_layers") or 0))


def _moe(family: str, cfg: dict[str, Any]) -> MoEArgs | None:
    """The sparse feed-forward of the MoE ones (None for dense Qwen3.5 or a config with no experts)."""
    count = n_experts(cfg) if family != "qwen3_5" else 0
    if not count:
        return None
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return MoEArgs(n_experts=count, top_k=int(cfg["num_experts_per_tok"]),
                   expert_dim=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=True if family == "qwen3_5_moe" else bool(cfg.get("norm_topk_prob", True)),
                   dense_layers=dense_layers(cfg) if family == "qwen3_next" else (), shared_dim=shared,
                   shared_gate=bool(shared))
