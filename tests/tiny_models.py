"""Tiny random-weight Llama-family checkpoints, written as REAL Hugging Face checkpoints for the tests.

Each checkpoint is what `save_pretrained` writes (config.json, model.safetensors, generation_config.json) plus a
byte-level BPE tokenizer built in memory with `tokenizers` (tokenizer.json, tokenizer_config.json and a jinja
chat template), so the real loader, tokenizer wrapper, quantizer and pager run on it and transformers' own
implementation can serve as the reference. Nothing is downloaded.

Weights are deliberately NOT the transformers default init: the std is 0.2 instead of 0.02 and the LM head is
scaled up so next-token distributions are peaked (greedy argmax chains are far from ties, which the fp32
exactness tests rely on), and biases and RMSNorm weights are random instead of 0 and 1, so an implementation
that forgets a bias or a norm weight produces different logits.

The pieces (tokenizer training, the family -> transformers classes table, the randomization, the perturbed
copy) are the package's own, specexec/checkpoints/demo_models.py, which `specexec demo` uses at a larger shape.

Does not know: the specexec runtime (except `load_pair_models`, which loads through it).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specexec.checkpoints.demo_models import (CORPUS, SPECIAL_TOKENS, save_tokenizer, train_tokenizer, write_perturbed,
                                          write_random)

# ---------------------------------------------------------------------------------------------- tokenizer

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3                     # SPECIAL_TOKENS' ids in the default tokenizer
VOCAB_SIZE = 320                                                # tokenizer vocab == model vocab_size

# The draft of the tokenizer-mismatch test: other special-token order, other vocabulary size.
OTHER_SPECIAL_TOKENS = ("</s>", "<s>", "<pad>", "<unk>")
OTHER_VOCAB_SIZE = 288
PREFIX_VOCAB_SIZE = 300        # the "prefix" tokenizer: the default's first 300 tokens (fewer BPE merges)


def write_tokenizer(dest: Path, variant: str = "default") -> Path:
    """Write a Llama-style tokenizer (BOS added on encode, chat template) into `dest`; return `dest`.

    variant "default": VOCAB_SIZE entries, <unk>=0 <s>=1 </s>=2 <pad>=3 <|system|>=4 <|user|>=5 <|assistant|>=6.
    variant "other": OTHER_VOCAB_SIZE entries with the specials in another order (ids disagree with "default").
    variant "prefix": the default's first PREFIX_VOCAB_SIZE entries (the same corpus, fewer merges).
    """
    if variant == "default":
        special, size, corpus = SPECIAL_TOKENS, VOCAB_SIZE, CORPUS
    elif variant == "prefix":
        special, size, corpus = SPECIAL_TOKENS, PREFIX_VOCAB_SIZE, CORPUS
    elif variant == "other":
        special, size, corpus = OTHER_SPECIAL_TOKENS, OTHER_VOCAB_SIZE, CORPUS[::-1]
    else:
        raise ValueError(f"unknown tokenizer variant {variant!r}; use 'default', 'prefix' or 'other'")
    tok = train_tokenizer(size, corpus, special)
    if tok.get_vocab_size() != size:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} entries, wanted {size}; "
                           "the embedded corpus is too small for that many merges")
    save_tokenizer(dest, tok, max_length=512)
    return Path(dest)


def tokenizer_ids(variant: str = "default") -> dict[str, int]:
    """bos/eos/pad/unk ids of a tokenizer variant, for the model config."""
    special = OTHER_SPECIAL_TOKENS if variant == "other" else SPECIAL_TOKENS
    return {name: special.index(tok) for name, tok in
            (("unk", "<unk>"), ("bos", "<s>"), ("eos", "</s>"), ("pad", "<pad>"))}


# ---------------------------------------------------------------------------------------------- models

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# Phi-3's LongRoPE for a 12-dimension partial rotary (6 factors each); tests pair it with a switch at 16 tokens.
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}

INIT_STD = 0.2        # transformers' default 0.02 gives near-uniform next-token distributions
HEAD_SCALE = 2.5      # LM head std = INIT_STD * HEAD_SCALE: logits std ~4, top-1 probability ~0.5 on average
DRAFT_PERTURB = 0.01  # relative noise of the perturbed draft: ~78% top-1 agreement with the 4-layer target


def tiny_config_kwargs(family: str, n_layers: int, vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    """The shape every tiny model shares: hidden 64, 4 heads of 16, 2 KV heads (GQA), MLP 128, 512 positions."""
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=n_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=512,
        rms_norm_eps=1e-6, initializer_range=INIT_STD, tie_word_embeddings=False,
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
    )
    if family == "qwen2":
        kw.update(use_sliding_window=False)
    if family == "qwen3":
        kw.update(use_sliding_window=False, attention_bias=False)
    if family == "mistral":
        kw.update(sliding_window=None)
    kw.update(MOE_SHAPES.get(family, {}))
    if family in HYBRIDS:
        kw.update(HYBRID_SHAPE)
    kw.update(family_kwargs(family, n_layers))
    return kw


# The MoE families' routed feed-forward at the tiny shape (every other field as above).
MOE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True,
                      use_sliding_window=False, attention_bias=False, mlp_only_layers=[], decoder_sparse_step=1),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False, use_sliding_window=False, decoder_sparse_step=2, mlp_only_layers=[]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=None),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False, clip_qkv=1.0),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=8),
    "glm4_moe": dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, n_group=4, topk_group=2,
                     routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
                     use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5, num_nextn_predict_layers=1),
    "minimax_m2": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, rotary_dim=12),
    "qwen3_next": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=[1]),
    "qwen3_5_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48),
    "deepseek_v3": dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
                        num_key_value_heads=4, head_dim=8, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=12, rms_norm_eps=1e-5, rope_interleave=True,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=128, mscale=0.7, mscale_all_dim=1.0,
                                             beta_fast=32, beta_slow=1)),
}

# The Qwen hybrids' linear-attention layers at the tiny shape: 2 key heads serving 4 value heads of 16, a
# 4-tap convolution; three linear layers to one gated full-attention layer (transformers' default pattern).
HYBRID_SHAPE = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4)
HYBRIDS = ("qwen3_next", "qwen3_5", "qwen3_5_mm", "qwen3_5_moe")


TINY_WINDOW = 6          # the sliding window of the tiny Gemma models: every test context runs past it


def family_kwargs(family: str, n_layers: int) -> dict[str, Any]:
    """What the tiny Gemma / Phi-3 checkpoints set beyond the shared shape, chosen so each family difference
    changes the logits: query_pre_attn_scalar 24 (not head_dim 16), soft caps small enough to bite (Gemma 2:
    attention 2, final 30; Gemma 3 names an attention cap that transformers ignores, and so must we), a
    window of 6 alternating with global layers (Gemma 3: two sliding to one global, a local RoPE base of 1e4
    and a linear-scaled global base of 1e6). Untied heads: a tied random head (scaled up for peaked logits)
    mostly predicts the input token back, and greedy runs would repeat one token. Phi-3: partial rotary
    (12 of 16 dims)."""
    gemma = dict(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=TINY_WINDOW,
                 tie_word_embeddings=False)
    if family == "gemma2":
        return dict(gemma, attn_logit_softcapping=2.0, final_logit_softcapping=30.0)
    if family in ("gemma3", "gemma3_mm"):
        kinds = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(n_layers)]
        rope = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        return dict(gemma, layer_types=kinds, rope_parameters=rope, attn_logit_softcapping=2.0,
                    final_logit_softcapping=None)
    if family == "phi3":
        return dict(partial_rotary_factor=0.75)
    if family in ("gemma4", "gemma4_mm", "gemma4_moe"):
        return gemma4_kwargs(family, n_layers)
    return {}


def gemma4_kwargs(family: str, n_layers: int) -> dict[str, Any]:
    """Gemma 4 at the tiny shape: a window of 6, two sliding layers to one full, full layers with heads of 32
    (not 16) and 1 KV head whose values are the keys' projection, proportional RoPE on the full layers (4 of
    their 16 angles turn), final soft cap 30. "gemma4" (and its multimodal checkpoint "gemma4_mm") adds per-layer
    inputs of 8 and the last two layers reading earlier layers' K/V with a double-wide MLP (E2B's features);
    "gemma4_moe" the routed block of 8 experts of 32, top 2, beside the dense MLP (26B-A4B's)."""
    kinds = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(n_layers)]
    kw = dict(hidden_activation="gelu_pytorch_tanh", sliding_window=TINY_WINDOW, layer_types=kinds,
              global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, final_logit_softcapping=30.0,
              tie_word_embeddings=False, hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB_SIZE)
    if family == "gemma4_moe":
        return dict(kw, enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)
    return dict(kw, hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True)


def write_tiny_model(dest: Path, family: str = "llama", seed: int = 0, n_layers: int = 2,
                     perturb: float | None = None, base: Path | None = None,
                     tokenizer: str = "default", **config_overrides: Any) -> Path:
    """Write a tiny random float32 checkpoint of `family` into `dest` (created); return `dest`.

    perturb + base: copy the checkpoint at `base` (config, tokenizer and all) and add to every weight tensor
    gaussian noise of std `perturb * rms(tensor)` drawn from `seed` -- a draft that partially agrees with
    `base`. `family`, `n_layers`, `tokenizer` and overrides do not apply then (overrides raise).
    tokenizer: "default", "prefix" or "other" (see write_tokenizer); the model's vocab_size and bos/eos/pad ids follow it.
    config_overrides: passed to the transformers config class, e.g. rope_scaling=LLAMA3_ROPE,
    tie_word_embeddings=True, num_hidden_layers is `n_layers`.
    """
    dest = Path(dest)
    if perturb is not None or base is not None:
        if perturb is None or base is None:
            raise ValueError(f"perturb ({perturb!r}) and base ({base!r}) go together")
        if config_overrides:
            raise ValueError(f"a perturbed copy keeps the base config; got overrides {sorted(config_overrides)}")
        return write_perturbed(dest, Path(base), perturb, seed)

    vocab = {"default": VOCAB_SIZE, "prefix": PREFIX_VOCAB_SIZE}.get(tokenizer, OTHER_VOCAB_SIZE)
    kw = tiny_config_kwargs(family, n_layers, vocab, tokenizer_ids(tokenizer))
    kw.update(config_overrides)
    write_random(dest, family, kw, seed, INIT_STD, HEAD_SCALE)
    write_tokenizer(dest, tokenizer)
    return dest


def load_pair_models(pair: tuple[Path, Path], perturbed: Path) -> dict:
    """The tiny pair loaded through specexec: target, an unrelated random draft and a perturbed copy."""
    from specexec.checkpoints.loading import load_model
    return {"target": load_model(pair[0]), "random": load_model(pair[1]), "perturbed": load_model(perturbed)}


def prompt(seed: int, n: int = 14) -> list[int]:
    """A reproducible random prompt of n ordinary token ids."""
    return torch.randint(7, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# The families beyond Llama (tests/network/test_families.py and friends): name -> (family, seed, layers, config
# overrides). phi3_long: LongRoPE switching at 16 tokens, so every test context crosses it.
FAMILY_MODELS: dict[str, tuple[str, int, int, dict]] = {
    "gemma2": ("gemma2", 30, 2, {}),
    "gemma3": ("gemma3", 31, 3, {}),
    "gemma3_mm": ("gemma3_mm", 32, 3, {}),
    "phi3": ("phi3", 33, 2, {}),
    "phi3_long": ("phi3", 34, 2, {"rope_scaling": LONGROPE, "original_max_position_embeddings": 16,
                                  "max_position_embeddings": 64}),
    "gemma4": ("gemma4", 35, 6, {}),
    "gemma4_mm": ("gemma4_mm", 36, 6, {}),
}


def family_model(root: Path, name: str) -> Path:
    """The tiny checkpoint of FAMILY_MODELS[name] under `root`, written once."""
    family, seed, layers, overrides = FAMILY_MODELS[name]
    path = root / f"family-{name}"
    if not (path / "config.json").exists():
        write_tiny_model(path, family, seed=seed, n_layers=layers, **overrides)
    return path


# The Qwen hybrids (tests/core/test_hybrid.py): name -> (family, seed). 4 layers each: linear, linear, linear, full
# attention; Qwen3-Next's layer 1 has a dense MLP (mlp_only_layers), the others' every layer is of one kind.
HYBRID_MODELS: dict[str, tuple[str, int]] = {
    "qwen3_5": ("qwen3_5", 40), "qwen3_next": ("qwen3_next", 41), "qwen3_5_moe": ("qwen3_5_moe", 42),
    "qwen3_5_mm": ("qwen3_5_mm", 43),
}


def hybrid_model_2layers(root: Path, name: str) -> Path:
    """HYBRID_MODELS[name] at 2 layers (one Gated DeltaNet layer, one full attention) under `root`, written once:
    what the tree-size and builder matrices run (the recurrent scratch's arithmetic does not depend on depth)."""
    family, seed = HYBRID_MODELS[name]
    path = root / f"hybrid-{name}-2layers"
    if not (path / "config.json").exists():
        write_tiny_model(path, family, seed=seed, n_layers=2, layer_types=["linear_attention", "full_attention"])
    return path


def hybrid_model(root: Path, name: str) -> Path:
    """The tiny checkpoint of HYBRID_MODELS[name] under `root`, written once."""
    family, seed = HYBRID_MODELS[name]
    path = root / f"hybrid-{name}"
    if not (path / "config.json").exists():
        write_tiny_model(path, family, seed=seed, n_layers=4)
    return path
