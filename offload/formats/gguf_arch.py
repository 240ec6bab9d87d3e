"""What differs between the GGUF architectures this reader takes: tensor names, stored-value conventions and the
metadata that becomes config.json keys (offload/formats/gguf.py reads the file; this says what it means).

Architectures (general.architecture -> HF architecture): llama (Llama and Mistral: llama.cpp writes Mistral as
llama), mistral, qwen2, qwen3, gemma2, gemma3 (the text decoder; a multimodal Gemma 3's vision tower goes to a
separate mmproj file), phi3 (Phi-3 and Phi-4).
- Names: blk.N.<name> -> model.layers.N.<module>, per architecture: ffn_norm is Llama's post-attention norm but
  Gemma's pre-feed-forward norm (Gemma's post_attention_norm / post_ffw_norm are its post-attention and
  post-feed-forward norms); Phi-3 keeps its fused attn_qkv and its fused gate+up as ffn_up (2 x n_ff rows).
- Values: llama.cpp permutes Llama/Mistral Q/K rows (gguf.py undoes it) and stores Gemma's RMSNorm weights
  with the 1 of (1 + weight) added (NORM_SHIFT: subtracted again here).
- Metadata: Gemma's soft caps and sliding window; query_pre_attn_scalar, which GGUF does not store: llama.cpp
  derives it from the model size (hidden / heads for the 27B models, else head_dim), and so does this; Gemma
  3's local RoPE base (10,000) and 5:1 pattern, fixed in llama.cpp too; Phi-3's partial rotary
  (rope.dimension_count), sliding window (0: none) and LongRoPE factors (rope_factors_long/short tensors,
  rope.scaling.original_context_length and attn_factor).

Does not know: the network, ModelArgs (specexec.families reads the config dict this builds), tokenizers.
"""
from __future__ import annotations

import re
from typing import Any

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
MOE_ARCHITECTURES = {"llama": "MixtralForCausalLM"}     # a "llama" file with an expert count is a Mixtral
PERMUTED_QK = frozenset({"llama", "mistral"})      # llama.cpp permutes Q/K rows for these (convert_hf_to_gguf.py)
NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}        # stored RMSNorm weight = HF weight + shift
NOT_WEIGHTS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})

GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
_GEMMA_NAMES = {**BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
ARCH_BLOCK_NAMES = {"gemma2": _GEMMA_NAMES, "gemma3": _GEMMA_NAMES,
                    "phi3": {**BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
LARGE_GEMMA_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models: llama.cpp scales queries by hidden / heads


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF tensor name of a llama.cpp tensor name of `arch`, or None when it is not one of its parameters."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    names = ARCH_BLOCK_NAMES.get(arch, BLOCK_NAMES)
    m = _BLOCK.match(gguf_name)
    if m is None or m.group(2) not in names:
        return None
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def head_dim_of(ckpt: Any, heads: int, kv: int) -> int:
    """Rows per head of the query projection (the fused qkv's split for Phi-3), unless key_length says."""
    if ckpt.arch == "phi3":
        rows = ckpt.shape("model.layers.0.self_attn.qkv_proj.weight")[0] // (heads + 2 * kv)
    else:
        rows = ckpt.shape("model.layers.0.self_attn.q_proj.weight")[0] // heads
    return int(ckpt._meta("attention.key_length", rows))


def arch_config(ckpt: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """The config.json keys of `ckpt`'s architecture beyond the shared ones in `cfg` (a GGUFCheckpoint:
    _meta(key, default), shape(name), rope factor tensors)."""
    arch = ckpt.arch
    if arch in ("gemma2", "gemma3"):
        large = cfg["num_hidden_layers"] == LARGE_GEMMA_LAYERS[arch]
        extra = {"query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if large
                 else cfg["head_dim"], "hidden_activation": "gelu_pytorch_tanh",
                 "final_logit_softcapping": ckpt._meta("final_logit_softcapping", None)}
        window = ckpt._meta("attention.sliding_window", None)
        if arch == "gemma2":
            extra.update(attn_logit_softcapping=ckpt._meta("attn_logit_softcapping", None), sliding_window=window)
        else:
            extra.update(attn_logit_softcapping=None, rope_local_base_freq=10000.0, sliding_window=window,
                         sliding_window_pattern=6 if window else 1)
        return extra
    if arch == "phi3":
        window = ckpt._meta("attention.sliding_window", None)
        rope_dim = int(ckpt._meta("rope.dimension_count", cfg["head_dim"]))
        extra = {"sliding_window": int(window) if window else None,
                 "partial_rotary_factor": rope_dim / cfg["head_dim"], "rope_scaling": None,
                 "original_max_position_embeddings": int(ckpt._meta("rope.scaling.original_context_length",
                                                                    cfg["max_position_embeddings"]))}
        if "rope_factors_long.weight" in ckpt._raw:
            extra["rope_scaling"] = {"rope_type": "longrope", "attention_factor": ckpt._meta(
                "rope.scaling.attn_factor", None), "long_factor": ckpt.factors("rope_factors_long.weight"),
                "short_factor": ckpt.factors("rope_factors_short.weight")}
        return extra
    return {}
