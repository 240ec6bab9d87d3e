"""The numbers of a config.json, checked before any family reads them: every size is a whole number (4, not
4.5, "4" or true) within bounds no real model leaves (a layer count of 1e9 would build modules until memory
runs out), every float field a finite number where the maths needs one (a norm epsilon or RoPE base of 0 gives
silent empty output), every token id an integer. One ConfigError line names the field, the value and the bound.

The tables name HF's keys as config.json spells them, for every family; a key a config does not have, or holds
as null, is left to the family's default. A nested text_config (multimodal checkpoints) and the RoPE dictionaries
(rope_parameters, rope_scaling, or one of them per layer kind) are checked the same way.

Does not know: which family reads which key (families/), what the checkpoint's tensors hold (checked against
config.json at load: specexec/checkpoints/loading.py).
"""
from __future__ import annotations

import math
from typing import Any

from specexec.options import ConfigError

LAYERS, WIDTH, EXPERTS, POSITIONS = 4096, 1 << 18, 1 << 16, 1 << 25      # 32M positions: past any real context

# key -> (lowest, highest) whole number
INTEGERS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, LAYERS), "hidden_size": (1, WIDTH), "intermediate_size": (1, 1 << 20),
    "num_attention_heads": (1, LAYERS), "num_key_value_heads": (1, LAYERS), "head_dim": (1, 4096),
    "vocab_size": (1, 1 << 24), "max_position_embeddings": (1, POSITIONS),
    "original_max_position_embeddings": (1, POSITIONS), "sliding_window": (0, POSITIONS),
    "max_window_layers": (0, LAYERS), "sliding_window_pattern": (1, LAYERS), "decoder_sparse_step": (1, LAYERS),
    "num_experts": (0, EXPERTS), "num_local_experts": (0, EXPERTS), "n_routed_experts": (0, EXPERTS),
    "num_experts_per_tok": (1, EXPERTS), "moe_intermediate_size": (1, 1 << 20), "n_shared_experts": (0, EXPERTS),
    "shared_expert_intermediate_size": (0, 1 << 20), "n_group": (1, EXPERTS), "topk_group": (1, EXPERTS),
    "first_k_dense_replace": (0, LAYERS), "num_nextn_predict_layers": (0, LAYERS), "num_mtp_layers": (0, LAYERS),
    "rotary_dim": (1, 4096), "kv_lora_rank": (1, WIDTH), "q_lora_rank": (1, WIDTH), "qk_rope_head_dim": (1, 4096),
    "qk_nope_head_dim": (1, 4096), "v_head_dim": (1, 4096), "linear_num_value_heads": (1, LAYERS),
    "linear_num_key_heads": (1, LAYERS), "linear_key_head_dim": (1, 4096), "linear_value_head_dim": (1, 4096),
    "linear_conv_kernel_dim": (1, 4096),
}
# key -> (lowest, highest, lowest excluded): a finite number
FLOATS: dict[str, tuple[float, float, bool]] = {
    "rms_norm_eps": (0.0, 1.0, True), "layer_norm_eps": (0.0, 1.0, True), "rope_theta": (0.0, 1e15, True),
    "rope_local_base_freq": (0.0, 1e15, True), "partial_rotary_factor": (0.0, 1.0, True),
    "routed_scaling_factor": (0.0, 1e6, True), "query_pre_attn_scalar": (0.0, 1e9, True),
    "attn_logit_softcapping": (0.0, 1e9, True), "final_logit_softcapping": (0.0, 1e9, True),
    "clip_qkv": (0.0, 1e9, True), "swiglu_limit": (0.0, 1e9, True), "swiglu_alpha": (-1e9, 1e9, False),
}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


ROPE_KEYS = ("rope_parameters", "rope_scaling")   # transformers 5's name, and the older one
# key -> (lowest, highest, lowest excluded) inside a RoPE dictionary (besides rope_theta, partial_rotary_factor and
# original_max_position_embeddings of the tables above): a factor of -2 had run, giving text of neither model
ROPE_FLOATS: dict[str, tuple[float, float, bool]] = {
    "factor": (0.0, 1e6, True), "low_freq_factor": (0.0, 1e6, True), "high_freq_factor": (0.0, 1e6, True),
    "attention_factor": (0.0, 1e6, True), "beta_fast": (0.0, 1e6, True), "beta_slow": (0.0, 1e6, True),
    "mscale": (0.0, 1e6, False), "mscale_all_dim": (0.0, 1e6, False),
}
ROPE_LISTS = ("short_factor", "long_factor")                   # LongRoPE's per-frequency factors


def whole(value: Any) -> bool:
    """An integer (or a float with no fraction, as some writers store 4096.0); never a bool or a string."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer())


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_integer(where: str, key: str, value: Any, low: int, high: int) -> None:
    """ConfigError unless `value` is a whole number in [low, high]."""
    if not whole(value):
        raise ConfigError(f"{where}: {key} must be a whole number, got {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{where}: {key} {value!r} is outside [{low}, {high}]; is this a real model's config?")


def check_float(where: str, key: str, value: Any, low: float, high: float, low_open: bool) -> None:
    """ConfigError unless `value` is a finite number in [low, high] ((low, high] when `low_open`)."""
    if not _finite(value):
        raise ConfigError(f"{where}: {key} must be a finite number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        bound = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ConfigError(f"{where}: {key} {value!r} is outside {bound}; the model cannot compute with it")


def _check_fields(cfg: dict[str, Any], where: str, integers: dict[str, tuple[int, int]],
                  floats: dict[str, tuple[float, float, bool]], names: dict[str, str] | None = None) -> None:
    names = names or {}
    for key, (low, high) in integers.items():
        if cfg.get(key) is not None:
            check_integer(where, names.get(key, key), cfg[key], low, high)
    for key, bounds in floats.items():
        if cfg.get(key) is not None:
            check_float(where, names.get(key, key), cfg[key], *bounds)


def check_rope(rope: Any, where: str) -> None:
    """A RoPE dictionary (rope_parameters / rope_scaling), or one per layer kind ({"full_attention": {...}}):
    ConfigError for its first number outside its type or bound."""
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise ConfigError(f"{where} must be an object of RoPE settings, got {rope!r}")
    for kind, nested in rope.items():
        if isinstance(nested, dict):
            check_rope(nested, f"{where} {kind}")
    _check_fields(rope, where, {"original_max_position_embeddings": INTEGERS["original_max_position_embeddings"]},
                  {**{k: FLOATS[k] for k in ("rope_theta", "partial_rotary_factor")}, **ROPE_FLOATS})
    for key in ROPE_LISTS:
        values = rope.get(key)
        if values is not None and not (isinstance(values, list) and all(_finite(v) and v > 0 for v in values)):
            raise ConfigError(f"{where}: {key} must be a list of positive numbers, got {str(values)[:80]}")


def check_config_values(cfg: dict[str, Any], where: str = "config.json", names: dict[str, str] | None = None) -> None:
    """ConfigError (one line) for the first number in `cfg` (its RoPE dictionaries and text_config included)
    outside its type or bound. `where` names the file; `names` what names a key there when the dict was built
    from another format (a GGUF file's metadata keys: offload GGUFCheckpoint.config_names)."""
    names = names or {}
    _check_fields(cfg, where, INTEGERS, FLOATS, names)
    for key in TOKEN_IDS:
        value = cfg.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(whole(i) and 0 <= i < 1 << 24 for i in ids if i is not None):
            raise ConfigError(f"{where}: {names.get(key, key)} must be a token id (or a list of them), got {value!r}")
    for key in ROPE_KEYS:
        check_rope(cfg.get(key), f"{where} {key}")
    if isinstance(cfg.get("text_config"), dict):
        check_config_values(cfg["text_config"], f"{where} text_config", names)
