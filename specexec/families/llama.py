"""The Llama family proper: Llama 2/3/3.x (llama3 RoPE scaling), Mistral (sliding window), Qwen2/2.5 (q/k/v
biases) and Qwen3 (q/k RMSNorm), all one pre-norm SwiGLU decoder. With use_sliding_window, Mistral slides in
every layer, Qwen in the layers its layer_types say (default: from max_window_layers on, as transformers).

Does not know: the network (specexec/network/model.py), checkpoints.
"""
from __future__ import annotations

from typing import Any

from specexec.config import ModelArgs
from specexec.families.common import base_fields, layer_types, sliding_window

# what this module's families add to Llama's maths, one line (the README's table, `specexec models`)
SUMMARY = ("Llama 2/3/3.x with llama3 RoPE scaling; Mistral's sliding window; Qwen2/2.5's q/k/v biases; Qwen3's "
           "q/k norms; Qwen's sliding layers from `max_window_layers`")
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def model_args(family: str, cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a Llama/Mistral/Qwen2/Qwen3 config.json."""
    window = sliding_window(cfg, default_on=family == "mistral")
    bias = bool(cfg.get("attention_bias", False))
    types: tuple[str, ...] = ()
    if window and family in ("qwen2", "qwen3"):    # Qwen slides only from layer max_window_layers on
        first = int(cfg.get("max_window_layers", 0))
        types = layer_types(cfg, lambda i: "sliding_attention" if i >= first else "full_attention")
    return ModelArgs(
        family=family,
        **base_fields(cfg),
        qkv_bias=family == "qwen2" or bias,
        o_bias=family != "qwen2" and bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=window,
        layer_types=types,
    )
