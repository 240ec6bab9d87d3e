"""Gemma 4 (text): Gemma4ForCausalLM and Gemma4ForConditionalGeneration's text decoder: config.json -> ModelArgs.

Gemma 3's decoder (embeddings x sqrt(hidden), norms around attention and the MLP, q/k RMSNorm per head, GeGLU,
sliding layers among full ones with their own RoPE, final-logit soft-capping) with Gemma 4's differences, each a
ModelArgs option:
- RMSNorm by its weight as stored (not 1 + weight); values RMS-normalised per head without a weight (v_norm);
  attention scores unscaled (attn_scale 1); each layer's output times a learned scalar (layer_scalar);
- full layers with their own head size and KV heads (global_head_dim, num_global_key_value_heads, or
  per_layer_config as transformers 5 saves it), their values the key projection where attention_k_eq_v, and
  their RoPE "proportional" (the first partial_rotary_factor of the angles over the whole head, base 1e6);
  sliding layers RoPE over their head at base 1e4;
- the last num_kv_shared_layers layers attend to the K/V of the last earlier layer of their kind and compute
  none (kv_shared_layers), their MLP twice as wide with use_double_wide_mlp;
- per-layer input embeddings (hidden_size_per_layer_input; the table embed_tokens_per_layer): each layer adds a
  gated projection of its own slice (ple_dim, ple_vocab);
- with enable_moe_block, a routed feed-forward beside the dense MLP (MoEArgs.parallel_dense): a softmax router
  on the RMS-normalised residual times a learned scale, top_k_experts renormalised and times a per-expert
  scale, experts of moe_intermediate_size with the GeGLU, stored fused (experts.gate_up_proj [E, 2I, D]: gate
  rows first; experts.down_proj [E, D, I]).
As transformers does, the last layer is made a full-attention layer whatever layer_types says.

Gemma4ForConditionalGeneration: only the text decoder runs (text prompts); its tensors live under
model.language_model.*, the vision and audio towers and their embedders are stored and never read.
Refused: bidirectional attention over every token (use_bidirectional_attention "all": not a causal model).

Does not know: the network (specexec/network/), how tensors are read.
"""
from __future__ import annotations

from typing import Any

from specexec.config import ModelArgs, MoEArgs
from specexec.families.common import base_fields, rope_scaling
from specexec.families.weight_rules import Rule
from specexec.options import ConfigError

# what this module's families add to Llama's maths, one line (the README's table, `specexec models`)
SUMMARY = ("Gemma 3's decoder with weight-only norms, values normed per head, unscaled scores and a scalar per "
           "layer; full layers with their own head size and KV heads, keys as values, proportional RoPE; the last "
           "layers reading an earlier layer's K/V (the ledger counts it once); per-layer input embeddings; the "
           "routed block beside the dense MLP (26B-A4B); the multimodal checkpoints run their text decoder")
ARCHITECTURES = {"Gemma4ForCausalLM": "gemma4", "Gemma4ForConditionalGeneration": "gemma4"}
STORED_PREFIXES = {"model.language_model.": "", "language_model.model.": "language_model."}
UNUSED = (r"(?:model\.)?(?:vision_tower|audio_tower|embed_vision|embed_audio|multi_modal_projector)\..*",)
ROPE_KINDS = ("default", "proportional")
E = r"mlp\.experts\.(\d+)\."
WEIGHT_RULES = (
    Rule(r"mlp\.router\.weight", "router.proj.weight"),
    Rule(r"mlp\.router\.(scale|per_expert_scale)", r"router.\1"),
    Rule(E + r"gate_proj\.weight", "experts.gate_up_proj", expert=True, half=0),
    Rule(E + r"up_proj\.weight", "experts.gate_up_proj", expert=True, half=1),
    Rule(E + r"down_proj\.weight", "experts.down_proj", expert=True),
    Rule(r"mlp\.dense\.(\w+)\.weight", r"mlp.\1.weight"),
    Rule(r"mlp\.dense_in_norm\.weight", "pre_feedforward_layernorm.weight"),
    Rule(r"mlp\.dense_out_norm\.weight", "post_feedforward_layernorm_1.weight"),
    Rule(r"mlp\.expert_in_norm\.weight", "pre_feedforward_layernorm_2.weight"),
    Rule(r"mlp\.expert_out_norm\.weight", "post_feedforward_layernorm_2.weight"),
)
# transformers' Gemma4TextConfig defaults for what a config (a text_config nested in a multimodal one) leaves out
DEFAULTS = dict(vocab_size=262144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                max_position_embeddings=131072, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                tie_word_embeddings=True, attention_bias=False, sliding_window=512, final_logit_softcapping=None,
                vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256, attention_k_eq_v=False,
                num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False)
ROPE_DEFAULTS = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1000000.0}}


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config (a multimodal config's text_config, the top level's ids and tying where it leaves
    them out), transformers' defaults below it."""
    text = cfg.get("text_config")
    if isinstance(text, dict):
        inherited = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
                     if k in cfg and k not in text}
        cfg = {**text, **inherited}
    return {**DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k == "final_logit_softcapping"}}


def model_args(family: str, cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a Gemma 4 config.json (its text_config for the multimodal checkpoints)."""
    cfg = text_config(cfg)
    if cfg.get("use_bidirectional_attention") == "all":
        raise ConfigError("this Gemma 4 config attends bidirectionally over every token (an encoder), not a "
                          "causal language model; not supported")
    if cfg["hidden_activation"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"unsupported Gemma 4 activation {cfg['hidden_activation']!r}; supported: "
                          "gelu_pytorch_tanh")
    n = int(cfg["num_hidden_layers"])
    kinds = list(cfg.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                            for i in range(n)])
    kinds[-1] = "full_attention"                       # transformers forces it
    global_dim, global_kv = _global_shape(cfg, kinds)
    rope = {**ROPE_DEFAULTS, **(cfg.get("rope_parameters") or {})}
    full, local = dict(rope["full_attention"]), dict(rope["sliding_attention"])
    fields = base_fields({**cfg, "rope_scaling": None, "rope_parameters": None})
    fields.update(rope_theta=float(full.pop("rope_theta")), rope_scaling=_scaling(full),
                  local_rope_theta=float(local.pop("rope_theta")), local_rope_scaling=_scaling(local))
    bias = bool(cfg["attention_bias"])
    cap = cfg.get("final_logit_softcapping")
    return ModelArgs(
        family=family, **fields, qkv_bias=bias, o_bias=bias, qk_norm=True, v_norm=True,
        sliding_window=int(cfg["sliding_window"]) if "sliding_attention" in kinds else None,
        layer_types=tuple(kinds), embed_scale=True, sandwich_norms=True, attn_scale=1.0,
        logit_softcap=float(cap) if cap else None, mlp_act="gelu_tanh", global_head_dim=global_dim,
        global_kv_heads=global_kv, global_k_eq_v=bool(cfg["attention_k_eq_v"]),
        kv_shared_layers=int(cfg["num_kv_shared_layers"] or 0), wide_shared_mlp=bool(cfg["use_double_wide_mlp"]),
        ple_dim=int(cfg["hidden_size_per_layer_input"] or 0),
        ple_vocab=int(cfg["vocab_size_per_layer_input"] or 0) if cfg["hidden_size_per_layer_input"] else 0,
        layer_scalar=True, moe=_moe(cfg))


def _global_shape(cfg: dict[str, Any], kinds: list[str]) -> tuple[int | None, int | None]:
    """(head size, KV heads) of the full-attention layers: global_head_dim (default 512) and
    num_global_key_value_heads (only where attention_k_eq_v, as transformers), or transformers 5's
    per_layer_config entries of those layers; None where they are the sliding layers' own."""
    per_layer = cfg.get("per_layer_config")
    if isinstance(per_layer, dict):
        full = [per_layer.get(str(i), per_layer.get(i)) for i, k in enumerate(kinds) if k == "full_attention"]
        shapes = {(e.get("head_dim"), e.get("num_key_value_heads")) for e in full if isinstance(e, dict)}
        if len(shapes) > 1:
            raise ConfigError(f"Gemma 4 config: its full-attention layers have {len(shapes)} different shapes in "
                              "per_layer_config; one is supported")
        dim, kv = shapes.pop() if shapes else (None, None)
    else:
        dim = cfg.get("global_head_dim", 512)
        kv = cfg.get("num_global_key_value_heads") if cfg["attention_k_eq_v"] else None
    return (int(dim) if dim else None), (int(kv) if kv else None)


def _scaling(params: dict[str, Any]) -> tuple | None:
    """The frozen RoPE scaling of one layer kind's rope_parameters (rope_theta taken out; None: default)."""
    if params.get("rope_type", "default") == "default":
        return None
    return rope_scaling({"rope_scaling": params}, ROPE_KINDS)


def _moe(cfg: dict[str, Any]) -> MoEArgs | None:
    """The routed block beside the dense MLP (enable_moe_block), else None."""
    if not cfg.get("enable_moe_block"):
        return None
    experts, top_k = int(cfg["num_experts"]), int(cfg["top_k_experts"])
    if top_k > experts:
        raise ConfigError(f"config.json's top_k_experts {top_k} is above num_experts {experts}")
    return MoEArgs(n_experts=experts, top_k=top_k, expert_dim=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=True, activation="gelu_tanh", router_input_norm=True, per_expert_scale=True,
                   parallel_dense=True)
