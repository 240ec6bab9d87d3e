"""Phi-3 and Phi-4 (Phi3ForCausalLM): config.json -> ModelArgs.

A pre-norm SwiGLU decoder like Llama, with its projections fused as the checkpoints store them: one qkv_proj
([q; k; v] rows) and one gate_up_proj ([gate; up] rows). They stay fused (fused_qkv, fused_gate_up): the
checkpoint's tensors are the network's parameters as they are (no split on load, nothing to map), one matmul
instead of three (two) per token, and a quantized layer packs one linear where there were three.

RoPE: partial rotary where the config says so (partial_rotary_factor: Phi-4-mini rotates 3/4 of each head),
and LongRoPE ("longrope", older configs "su"): per-frequency short and long factors, cos/sin scaled by the
attention factor (sqrt(1 + ln(max_position_embeddings / original) / ln(original)) unless given). Which
factors apply follows transformers: the long ones once the sequence exceeds original_max_position_embeddings
(specexec/network/rope.py; the engine re-runs the context when a generation crosses that length, as transformers'
generate does). A sliding window, where the config has one (Phi-3-mini-4k: 2047), applies to every layer.

Does not know: the network (specexec/network/model.py), checkpoints' tensors.
"""
from __future__ import annotations

import math
from typing import Any

from specexec.config import ModelArgs
from specexec.families.common import base_fields, check_activation, rope_scaling

# what this module's families add to Llama's maths, one line (the README's table, `specexec models`)
SUMMARY = ('Phi-3 and Phi-4: fused `qkv_proj` / `gate_up_proj` (kept fused), partial rotary, LongRoPE short/long'
           ' factors switching where transformers switches')
ARCHITECTURES = {"Phi3ForCausalLM": "phi3"}
ROPE_KINDS = ("default", "longrope", "su")
DEFAULTS = dict(rms_norm_eps=1e-5, max_position_embeddings=4096, original_max_position_embeddings=4096,
                rope_theta=10000.0, hidden_act="silu", bos_token_id=1, eos_token_id=32000)


def model_args(family: str, cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a Phi-3 / Phi-4 config.json."""
    cfg = {**DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    check_activation(cfg, family)
    fields = base_fields({**cfg, "rope_scaling": None, "rope_parameters": None})
    rope = cfg.get("rope_parameters") or {}
    fields["rope_theta"] = float(rope.get("rope_theta", cfg["rope_theta"]))
    fields["rope_scaling"] = _longrope(cfg, rope)
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    window = cfg.get("sliding_window")
    return ModelArgs(
        family=family, **fields, fused_qkv=True, fused_gate_up=True,
        rope_dim=int(fields["head_dim"] * partial) if partial != 1.0 else None,
        sliding_window=int(window) if window else None,
    )


def _longrope(cfg: dict[str, Any], rope: dict[str, Any]) -> tuple | None:
    """The frozen longrope scaling (rope_type longrope, short/long factors as tuples, original context,
    factor and attention factor as transformers derives them), or None for plain RoPE."""
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", rope.get("type", "default")) != "default"
                                          else None)
    if not scaling:
        return None
    frozen = dict(rope_scaling({"rope_scaling": scaling}, ROPE_KINDS))
    original = int(cfg["original_max_position_embeddings"])         # transformers: the top level wins
    factor = scaling.get("factor") or cfg["max_position_embeddings"] / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    frozen.update(rope_type="longrope", original_max_position_embeddings=original, attention_factor=attention,
                  short_factor=tuple(float(x) for x in scaling["short_factor"]),
                  long_factor=tuple(float(x) for x in scaling["long_factor"]))
    for key in ("type", "rope_theta", "partial_rotary_factor", "factor"):    # read elsewhere, or folded in
        frozen.pop(key, None)
    return tuple(sorted(frozen.items()))
