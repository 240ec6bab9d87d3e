"""Gemma 2 and Gemma 3 (text): config.json -> ModelArgs, and where their checkpoints keep the text decoder.

Both: embeddings scaled by sqrt(hidden) (embed_scale), RMSNorm by (1 + weight) (norm_plus_one), norms before
and after attention and the MLP (sandwich_norms), scores scaled by query_pre_attn_scalar ** -0.5 (attn_scale),
GeGLU (gelu tanh), sliding-window layers among global ones (layer_types), tied embeddings unless the config
says otherwise. Gemma 2 adds attention-logit and final-logit soft-capping (50 and 30 unless the config says
null) and alternates sliding / global from layer 0. Gemma 3 adds q/k RMSNorm, five sliding layers to one
global (sliding_window_pattern 6), a local RoPE base for its sliding layers (rope_local_base_freq, no scaling)
and the config's RoPE scaling for the global ones; transformers' Gemma 3 applies no attention soft-capping
even when the config names one, so neither does this.

Gemma3ForConditionalGeneration (the 4B/12B/27B checkpoints on the Hub are multimodal): its text_config is the
decoder and only the decoder is run: the vision tower and the multimodal projector are not used (their tensors
are skipped, never read), and prompts are text only. Its tensors live under language_model.model.* (Hub
checkpoints, the head beside it as language_model.lm_head) or model.language_model.* (saved by transformers 5,
the head at the top level): STORED_PREFIXES for specexec/checkpoints/weight_map.py, which reads both; UNUSED names the
vision tower and projector.

Does not know: the network (specexec/network/model.py), tensors' data.
"""
from __future__ import annotations

from typing import Any

from specexec.config import ModelArgs
from specexec.families.common import base_fields, layer_types, rope_scaling
from specexec.options import ConfigError

# what this module's families add to Llama's maths, one line (the README's table, `specexec models`)
SUMMARY = ('embeddings x sqrt(hidden), (1 + w) norms around attention and MLP, `query_pre_attn_scalar`, sliding '
           '/ global layers, GeGLU; Gemma 2: attention and final-logit soft-capping; Gemma 3: q/k norms, 5 '
           'sliding : 1 global layers with a local RoPE base, and the multimodal 4B-27B checkpoints run their '
           'text decoder (text prompts only)')
ARCHITECTURES = {
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
}
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}
ROPE_KINDS = ("default", "linear", "llama3")
# where the multimodal checkpoints keep the text decoder -> where its head (specexec/checkpoints/weight_map.py)
STORED_PREFIXES = {"language_model.model.": "language_model.", "model.language_model.": ""}
UNUSED = (r"(?:model\.)?(?:vision_tower|vision_model|multi_modal_projector)\..*",)   # stored, never read

# transformers' defaults for what a config.json may leave out (a Gemma 3 text_config nested in a multimodal
# config carries only what differs from them).
DEFAULTS = {
    "gemma2": dict(vocab_size=256000, head_dim=256, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192,
                   query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                   bos_token_id=2, eos_token_id=1),
    "gemma3": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                   rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, max_position_embeddings=131072,
                   query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
                   final_logit_softcapping=None, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                   bos_token_id=2, eos_token_id=1),
}


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: a multimodal config's text_config (special token ids and tie_word_embeddings from
    the top level where the text part leaves them out), or the config itself; transformers' defaults below."""
    family = "gemma2" if "Gemma2ForCausalLM" in (cfg.get("architectures") or []) else "gemma3"
    text = cfg.get("text_config")
    if isinstance(text, dict):
        inherited = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
                     if k in cfg and k not in text}
        cfg = {**text, **inherited}
    return {**DEFAULTS[family], **{k: v for k, v in cfg.items() if v is not None or k.endswith("softcapping")}}


def model_args(family: str, cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a Gemma 2 / Gemma 3 config.json (text_config for the multimodal Gemma 3)."""
    cfg = text_config(cfg)
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("this Gemma config attends bidirectionally (an embedding model such as EmbeddingGemma), "
                          "not a causal language model; not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act not in ACTIVATIONS:
        raise ConfigError(f"unsupported Gemma activation {act!r}; supported: {', '.join(ACTIVATIONS)}")
    every = 2 if family == "gemma2" else int(cfg.get("sliding_window_pattern") or 6)
    kinds = layer_types(cfg, lambda i: "sliding_attention" if (i + 1) % every else "full_attention")
    theta, scaling = _global_rope(cfg)
    rope: dict[str, Any] = dict(rope_theta=theta, rope_scaling=scaling)
    if family == "gemma3":
        rope["local_rope_theta"], rope["local_rope_scaling"] = _local_rope(cfg)
    fields = {**base_fields(cfg), **rope}
    fields["tie_word_embeddings"] = bool(cfg["tie_word_embeddings"])
    attn_cap = cfg.get("attn_logit_softcapping") if family == "gemma2" else None
    return ModelArgs(
        family=family, **fields, qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)), qk_norm=family == "gemma3",
        sliding_window=int(cfg["sliding_window"]) if "sliding_attention" in kinds else None,
        layer_types=kinds,
        embed_scale=True, norm_plus_one=True, sandwich_norms=True,
        attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
        attn_softcap=float(attn_cap) if attn_cap else None,
        logit_softcap=float(cfg["final_logit_softcapping"]) if cfg.get("final_logit_softcapping") else None,
        mlp_act=ACTIVATIONS[act],
    )


def _global_rope(cfg: dict[str, Any]) -> tuple[float, tuple | None]:
    """(base, frozen scaling) of the global layers: rope_theta / rope_scaling, or transformers 5's
    rope_parameters (per layer type for Gemma 3, flat for Gemma 2)."""
    params = cfg.get("rope_parameters") or {}
    params = params.get("full_attention", params) if isinstance(params.get("full_attention"), dict) else params
    theta = float(params.get("rope_theta", cfg.get("rope_theta")))
    scaling = rope_scaling({"rope_scaling": cfg.get("rope_scaling") or _non_default(params)}, ROPE_KINDS)
    return theta, scaling


def _local_rope(cfg: dict[str, Any]) -> tuple[float, tuple | None]:
    """(base, frozen scaling) of Gemma 3's sliding layers: rope_local_base_freq, unscaled (or rope_parameters'
    sliding_attention entry)."""
    params = (cfg.get("rope_parameters") or {}).get("sliding_attention")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_local_base_freq")))
        return theta, rope_scaling({"rope_scaling": _non_default(params)}, ROPE_KINDS)
    return float(cfg["rope_local_base_freq"]), None


def _non_default(params: dict[str, Any]) -> dict[str, Any] | None:
    kind = params.get("rope_type", params.get("type", "default"))
    return {k: v for k, v in params.items() if k != "rope_theta"} if kind != "default" else None
