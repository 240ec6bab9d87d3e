"""The Llama family proper: Llama 2/3/3.x (llama3 RoPE scaling), Mistral (sliding window), Qwen2/2.5 (q/k/v
biases) and Qwen3 (q/k RMSNorm), all one pre-norm SwiGLU decoder.

Does not know: the network (specexec/model.py), checkpoints.
"""
from __future__ import annotations

from typing import Any

from specexec.config import ModelArgs
from specexec.families.common import base_fields, sliding_window

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def model_args(family: str, cfg: dict[str, Any]) -> ModelArgs:
    """ModelArgs of a Llama/Mistral/Qwen2/Qwen3 config.json."""
    bias = bool(cfg.get("attention_bias", False))
    return ModelArgs(
        family=family,
        **base_fields(cfg),
        qkv_bias=family == "qwen2" or bias,
        o_bias=family != "qwen2" and bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=sliding_window(cfg, default_on=family == "mistral"),
    )
