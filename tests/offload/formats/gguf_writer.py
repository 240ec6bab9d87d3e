"""Write a tiny HF checkpoint (tests/tiny_models.py) as a llama.cpp-style GGUF file with gguf.GGUFWriter.

What llama.cpp's convert_hf_to_gguf.py does for the Llama family, Gemma 2/3, Phi-3 and the MoE families (Qwen3-MoE,
Mixtral, GLM-4.5 with its shared experts, score bias and next-token-prediction layer, MiniMax-M2, DeepSeek-V3 with
its latent attention's kv_b_proj split in two), reduced to what
the tests need: llama.cpp tensor names (per architecture; experts merged into one blk.N.ffn_*_exps tensor per
projection), Gemma's norm weights stored as 1 + weight, Phi-3's LongRoPE
factors as tensors, Q/K rows permuted for its rope layout on Llama/Mistral (its `LlamaModel.permute`, copied below),
1-D tensors (norms, biases) kept F32, 2-D weights stored as the requested type (F32, F16, BF16, or a type the
`gguf` package can quantize in Python: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), no output.weight when the head is tied,
Llama-3 rope scaling as a rope_freqs tensor, and the byte-level BPE tokenizer as tokenizer.ggml.* metadata.
K-quant types cannot be quantized in Python (gguf has only their dequantizers): `random_kquant_blocks` makes
valid random blocks of them instead.

Does not know: specexec (the tests compare what specexec reads against these files).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch

GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "llama",
        "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3",
        "Phi3ForCausalLM": "phi3", "Glm4MoeForCausalLM": "glm4moe", "MiniMaxM2ForCausalLM": "minimax-m2",
        "DeepseekV3ForCausalLM": "deepseek2"}
GEMMA_BLOCK = {**BLOCK, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
ARCH_BLOCK = {"gemma2": GEMMA_BLOCK, "gemma3": GEMMA_BLOCK,
              "phi3": {**BLOCK, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
              "glm4moe": {**BLOCK, "post_attention_layernorm": "post_attention_norm",
                          "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
                          "mlp.shared_experts.down_proj": "ffn_down_shexp"},
              "deepseek2": {**BLOCK, "self_attn.q_a_proj": "attn_q_a", "self_attn.q_b_proj": "attn_q_b",
                            "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
                            "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
                            "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
                            "mlp.shared_experts.down_proj": "ffn_down_shexp"}}
SCORE_BIAS = ("mlp.gate.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias")   # -> exp_probs_b.bias
# MoE: the router and the per-expert Hub tensors that llama.cpp merges into one [E, out, in] tensor per layer
ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight")
EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
MERGED = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
          "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in GLOBAL:
        return GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)                    # model.layers.N.<module>.<weight|bias>
    if rest in ROUTERS:
        return f"blk.{layer}.ffn_gate_inp.weight"
    if rest in SCORE_BIAS:
        return f"blk.{layer}.exp_probs_b.bias"
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{ARCH_BLOCK.get(arch, BLOCK)[module]}.{kind}"


def text_tensors(tensors: dict, cfg: dict) -> dict:
    """A multimodal Gemma 3's text decoder under HF *ForCausalLM names (llama.cpp puts the vision tower into a
    separate mmproj file); every other checkpoint as it is."""
    if "text_config" not in cfg:
        return tensors
    out = {"model." + n.removeprefix("language_model.model."): t for n, t in tensors.items()
           if n.startswith("language_model.model.")}
    if "language_model.lm_head.weight" in tensors:
        out["lm_head.weight"] = tensors["language_model.lm_head.weight"]
    return out


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def llama3_scaling(cfg: dict) -> dict | None:
    """The llama3 rope scaling of a config.json (transformers >= 5 writes it as rope_parameters), else None."""
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    return rs if rs.get("rope_type", rs.get("type")) == "llama3" else None


def rope_theta(cfg: dict) -> float:
    return float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)))


def llama3_rope_freqs(cfg: dict) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: the rope_freqs factors of a llama3 rope."""
    rs = llama3_scaling(cfg)
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope_theta(cfg) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rs.get("factor", 8.0), rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old = rs.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def encode(arr: np.ndarray, qtype: str) -> tuple[np.ndarray, object]:
    """(bytes or float array, raw_dtype) for GGUFWriter.add_tensor."""
    import gguf

    if qtype == "F32":
        return arr.astype(np.float32), None
    if qtype == "F16":
        return arr.astype(np.float16), None
    kind = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.quantize(arr.astype(np.float32), kind), kind


def random_kquant_blocks(rows: int, cols: int, qtype: str, seed: int, scale: float) -> np.ndarray:
    """uint8 [rows, cols/256*type_size] of random but valid K-quant blocks: random codes and sub-scales, and
    super-block scales (fp16 d, dmin) set to `scale`-sized values so the weights are O(scale)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    d = np.full((raw.shape[0], 1), scale, dtype=np.float16).view(np.uint8)
    dmin = np.full((raw.shape[0], 1), scale / 2, dtype=np.float16).view(np.uint8)
    if qtype in ("Q4_K", "Q5_K"):                      # d, dmin, scales, [qh,] qs
        raw[:, 0:2], raw[:, 2:4] = d, dmin
    elif qtype == "Q2_K":                              # scales, qs, d, dmin
        raw[:, size - 4:size - 2], raw[:, size - 2:] = d, dmin
    elif qtype in ("Q6_K", "Q3_K"):                    # ..., d
        raw[:, size - 2:] = d
    else:
        raise ValueError(f"no random-block layout for {qtype}")
    return raw.reshape(rows, -1)


def tokenizer_metadata(hf_dir: Path) -> dict:
    """tokens / token types / merges / special ids / chat template of the tiny tokenizer, llama.cpp style."""
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = tj["model"]["vocab"]
    for added in tj["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tj["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    template = cfg.get("chat_template")
    if template is None and (hf_dir / "chat_template.jinja").is_file():
        template = (hf_dir / "chat_template.jinja").read_text()
    return {"tokens": tokens, "types": [3 if t in special else 1 for t in tokens], "merges": merges,
            "template": template, "ids": {t: vocab[t] for t in ("<s>", "</s>", "<pad>", "<unk>")}}


def write_gguf(hf_dir: Path, dest: Path, qtype: str = "F32", tokenizer: bool = True,
               kquant: str | None = None, extra: dict[str, np.ndarray] | None = None, split_kv_b: bool = True) -> Path:
    """Write hf_dir (a tiny checkpoint) as the GGUF file `dest`; 2-D weights as `qtype`.

    kquant: instead of the checkpoint's values, store every 2-D decoder weight as random valid blocks of that
    K-quant type (needs row lengths that are multiples of 256). extra: more tensors under their GGUF names, F32
    (e.g. a layout the reader must refuse). split_kv_b (deepseek2): write kv_b_proj as llama.cpp's converter
    does since its MLA keys, attn_k_b (transposed) and attn_v_b; False: whole, with the older metadata."""
    import gguf
    from safetensors.torch import load_file

    top = json.loads((hf_dir / "config.json").read_text())
    cfg = {**top, **top.get("text_config", {})}
    arch = ARCH[top["architectures"][0]]
    writer = gguf.GGUFWriter(str(dest), arch)
    _write_hparams(writer, cfg, arch)
    _write_family_hparams(writer, cfg, arch)
    if arch == "deepseek2":
        _write_deepseek_hparams(writer, cfg, split_kv_b)
    if tokenizer:
        _write_tokenizer(writer, tokenizer_metadata(hf_dir))
    tensors = merge_experts(text_tensors(load_file(hf_dir / "model.safetensors"), top))
    if arch == "deepseek2":
        tensors = deepseek_tensors(tensors, cfg, split_kv_b)
    if llama3_scaling(cfg):
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))
    rope = cfg.get("rope_parameters") or {}
    if arch == "phi3" and rope.get("long_factor"):          # Phi3MiniModel.generate_extra_tensors
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for i, (name, t) in enumerate(sorted(tensors.items())):
        arr = _permuted(name, t.float().numpy(), cfg, arch)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            arr = arr + 1                                    # llama.cpp stores Gemma's (1 + weight)
        if arr.ndim == 1:
            data, raw = arr.astype(np.float32), None
        elif kquant and name.startswith("model.layers."):
            data = random_kquant_blocks(arr.shape[0], arr.shape[1], kquant, seed=i, scale=0.002)
            raw = gguf.GGMLQuantizationType[kquant]
        else:
            data, raw = encode(arr, qtype)
        writer.add_tensor(name if name.startswith("blk.") else gguf_name(name, arch), data, raw_dtype=raw)
    if arch == "glm4moe":                                    # the next-token-prediction layer's own tensors
        n, dim = cfg["num_hidden_layers"], cfg["hidden_size"]
        for name, shape in (("eh_proj", (dim, 2 * dim)), ("enorm", (dim,)), ("hnorm", (dim,)),
                            ("shared_head_norm", (dim,))):
            writer.add_tensor(f"blk.{n}.nextn.{name}.weight", np.ones(shape, dtype=np.float32))
    for name, arr in (extra or {}).items():
        writer.add_tensor(name, arr.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def deepseek_tensors(tensors: dict, cfg: dict, split_kv_b: bool) -> dict:
    """DeepseekV2Model.modify_tensors: the next-token-prediction layers (after num_hidden_layers) dropped; with
    split_kv_b, each kv_b_proj [H * (nope + v), r] as blk.N.attn_k_b [H, r, nope] and blk.N.attn_v_b [H, v, r]."""
    out = {}
    for name, t in tensors.items():
        m = re.match(r"^(?:model\.layers|blk)\.(\d+)\.", name)
        if m and int(m.group(1)) >= cfg["num_hidden_layers"]:
            continue
        if split_kv_b and name.endswith("self_attn.kv_b_proj.weight"):
            heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            k_b, v_b = t.view(heads, nope + v, t.shape[-1]).split([nope, v], dim=1)
            out[f"blk.{m.group(1)}.attn_k_b.weight"] = k_b.transpose(1, 2).contiguous()
            out[f"blk.{m.group(1)}.attn_v_b.weight"] = v_b.contiguous()
            continue
        out[name] = t
    return out


def merge_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's per-expert tensors stacked, expert outermost, under llama.cpp's merged names
    (blk.N.ffn_{gate,up,down}_exps [E, out, in]); every other tensor as it is."""
    out, groups = {}, {}
    for name, t in tensors.items():
        m = EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(f"blk.{m.group(1)}.{MERGED[m.group(3)]}.weight", {})[int(m.group(2))] = t
    for name, experts in groups.items():
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def _permuted(name: str, arr: np.ndarray, cfg: dict, arch: str) -> np.ndarray:
    if arch != "llama":
        return arr
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return llama_cpp_permute(arr, cfg["num_attention_heads"], cfg["num_attention_heads"])
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return llama_cpp_permute(arr, cfg["num_attention_heads"], cfg["num_key_value_heads"])
    return arr


def _write_hparams(writer, cfg: dict, arch: str) -> None:
    writer.add_name("tiny test model")
    writer.add_block_count(cfg["num_hidden_layers"] + (cfg.get("num_nextn_predict_layers") or 0 if arch == "glm4moe"
                                                       else 0))       # llama.cpp counts GLM's MTP layer in
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("full_attention", {}).get("rope_theta", rope_theta(cfg))))
    if arch == "deepseek2":                                  # its head widths: _write_deepseek_hparams
        return _write_experts(writer, cfg)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if arch != "phi3":                                       # Phi3MiniModel writes no key/value length
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    _write_experts(writer, cfg)


def _write_experts(writer, cfg: dict) -> None:
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])


def _write_family_hparams(writer, cfg: dict, arch: str) -> None:
    """What convert_hf_to_gguf.py's Gemma2Model / Gemma3Model / Phi3MiniModel add (query_pre_attn_scalar and
    Gemma 3's local RoPE and pattern are not stored: the reader derives them as llama.cpp does)."""
    import math

    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        writer.add_sliding_window(cfg["sliding_window"])
    elif arch == "gemma3":
        full = rope.get("full_attention", rope)
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        writer.add_sliding_window(cfg["sliding_window"])
    elif arch == "glm4moe":                                  # Glm4MoeModel.set_gguf_parameters
        writer.add_expert_shared_count(cfg["n_shared_experts"])
        writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
        writer.add_expert_weights_norm(cfg["norm_topk_prob"])
        writer.add_expert_gating_func(__import__("gguf").ExpertGatingFuncType.SIGMOID)
        writer.add_expert_group_count(cfg["n_group"])
        writer.add_expert_group_used_count(cfg["topk_group"])
        writer.add_nextn_predict_layers(cfg.get("num_nextn_predict_layers", 0))
    elif arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
        if rope.get("long_factor"):
            scale = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(cfg["original_max_position_embeddings"])))


def _write_deepseek_hparams(writer, cfg: dict, split_kv_b: bool) -> None:
    """DeepseekV2Model.set_gguf_parameters (and the generic MoE / YaRN keys it inherits): MQA with one KV head
    of kv_lora_rank + rope values since llama.cpp's MLA keys, the head widths under key/value_length before."""
    import gguf

    rope_dim, kv_rank = cfg["qk_rope_head_dim"], cfg["kv_lora_rank"]
    writer.add_head_count_kv(1 if split_kv_b else cfg["num_attention_heads"])
    writer.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    writer.add_q_lora_rank(cfg["q_lora_rank"])
    writer.add_kv_lora_rank(kv_rank)
    if split_kv_b:
        writer.add_key_length(kv_rank + rope_dim)
        writer.add_value_length(kv_rank)
        writer.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dim)
        writer.add_value_length_mla(cfg["v_head_dim"])
    else:
        writer.add_key_length(cfg["qk_nope_head_dim"] + rope_dim)
        writer.add_value_length(cfg["v_head_dim"])
    writer.add_expert_shared_count(cfg["n_shared_experts"])
    writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg["norm_topk_prob"]:
        writer.add_expert_weights_norm(True)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX if cfg.get("scoring_func") == "softmax"
                                  else gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_group_count(cfg["n_group"])
    writer.add_expert_group_used_count(cfg["topk_group"])
    writer.add_rope_dimension_count(rope_dim)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _write_tokenizer(writer, tok: dict) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    writer.add_token_merges(tok["merges"])
    writer.add_bos_token_id(tok["ids"]["<s>"])
    writer.add_eos_token_id(tok["ids"]["</s>"])
    writer.add_pad_token_id(tok["ids"]["<pad>"])
    writer.add_unk_token_id(tok["ids"]["<unk>"])
    writer.add_add_bos_token(True)
    if tok["template"]:
        writer.add_chat_template(tok["template"])
