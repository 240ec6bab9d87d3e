"""What each GGUF architecture this reader takes means: one table entry per architecture (`ARCHS`) with its HF
architecture, its llama.cpp tensor names -> Hub names, its merged experts and its stored-value conventions,
then the metadata that becomes config.json keys (offload/formats/gguf.py reads the file; this says what it means).

Architectures (general.architecture -> HF architecture): llama (Llama and Mistral: llama.cpp writes Mistral as
llama; with an expert count, Mixtral), mistral, qwen2, qwen3, gemma2, gemma3 (the text decoder; a multimodal
Gemma 3's vision tower goes to a separate mmproj file), phi3 (Phi-3 and Phi-4), qwen3moe, glm4moe (GLM-4.5+: the
next-token-prediction layer llama.cpp counts in block_count is read as the layer after the decoder, which the
model leaves unread; its shared experts ffn_*_shexp, the router's score bias exp_probs_b.bias), minimax-m2,
deepseek2 (DeepSeek-V3/R1/V3.1 and Kimi-K2, read as DeepseekV3ForCausalLM: latent attention's attn_q_a/q_b,
attn_kv_a_mqa, the *_norm of both ranks, and kv_b_proj either whole (attn_kv_b, older files) or as llama.cpp's
halves attn_k_b [H, r, nope] / attn_v_b [H, v, r] joined back (`join_kv_b`); the next-token-prediction layer,
which llama.cpp's converter drops; softmax-gated files, DeepSeek-V2 / V2.5, refused).
Not read yet (refused by name): gemma4, and every other architecture.
- Names: token_embd -> model.embed_tokens, output_norm -> model.norm, output -> lm_head, blk.N.<name> ->
  model.layers.N.<module> per architecture: ffn_norm is Llama's post-attention norm but Gemma's pre-feed-forward
  norm (Gemma's post_attention_norm / post_ffw_norm are its post-attention and post-feed-forward norms); Phi-3
  keeps its fused attn_qkv and its fused gate+up as ffn_up (2 x n_ff rows).
- Experts: a mixture of experts stores its routed experts MERGED, one tensor per projection and layer
  (blk.N.ffn_{gate,up,down}_exps [E, out, in], expert outermost): each becomes the E per-expert Hub names of its
  family (Qwen3-MoE: mlp.experts.e.{gate,up,down}_proj; Mixtral: block_sparse_moe.experts.e.{w1,w3,w2}), each
  read as its own slice of the file (`Piece.expert`); the router blk.N.ffn_gate_inp is the family's gate. Old
  Mixtral files that store experts one by one (blk.N.ffn_gate.E) map the same way. Any other expert layout
  (fused gate+up, shared experts, ...) maps to nothing, and the reader refuses the tensor by name.
- Values: llama.cpp permutes Llama/Mistral Q/K rows (`Arch.permuted_qk`: gguf.py undoes it) and stores Gemma's
  RMSNorm weights with the 1 of (1 + weight) added (`Arch.norm_shift`: subtracted again).
- Metadata: Gemma's soft caps and sliding window; query_pre_attn_scalar, which GGUF does not store: llama.cpp
  derives it from the model size (hidden / heads for the 27B models, else head_dim), and so does this; Gemma
  3's local RoPE base (10,000) and 5:1 pattern, fixed in llama.cpp too; Phi-3's partial rotary
  (rope.dimension_count), sliding window (0: none) and LongRoPE factors (rope_factors_long/short tensors,
  rope.scaling.original_context_length and attn_factor); an MoE file's expert count, experts per token and
  width, and its dense layers (those without a router).

Does not know: reading bytes (gguf.py), the network, ModelArgs (specexec.families reads the config dict this
builds and maps the Hub names onto the network's), tokenizers.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from offload.formats.checkpoint import CheckpointError

GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
_GEMMA_NAMES = {**BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_PHI3_NAMES = {**BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_SHARED_EXPERTS = {"ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
                   "ffn_down_shexp": "mlp.shared_experts.down_proj"}
_GLM_NAMES = {**{k: v for k, v in BLOCK_NAMES.items() if k != "ffn_norm"},
              "post_attention_norm": "post_attention_layernorm", **_SHARED_EXPERTS}
_MLA_NAMES = {**BLOCK_NAMES, **_SHARED_EXPERTS, "attn_q_a": "self_attn.q_a_proj", "attn_q_b": "self_attn.q_b_proj",
              "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
              "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj"}
KV_B_PARTS = {"attn_k_b": "k", "attn_v_b": "v"}    # deepseek2's kv_b_proj as llama.cpp splits it (join_kv_b)


@dataclass(frozen=True)
class Arch:
    """One GGUF architecture: its HF architecture (`moe_hf` instead for a file with an expert count), its block
    tensor names (llama.cpp name inside blk.N -> Hub module inside model.layers.N), its router and merged expert
    tensors (-> per-expert Hub name with {e}), whether llama.cpp permuted its Q/K rows, and what it added to its
    stored RMSNorm weights."""

    hf: str
    block: dict[str, str] = field(default_factory=lambda: BLOCK_NAMES)
    moe_hf: str | None = None
    router: str | None = None
    experts: dict[str, str] = field(default_factory=dict)
    permuted_qk: bool = False
    norm_shift: float = 0.0
    score_bias: str | None = None         # the router's e_score_correction_bias (llama.cpp's exp_probs_b.bias)
    partial_rotary: bool = False          # rope.dimension_count may be less than the head
    kv_b_parts: bool = False              # blk.N.attn_k_b / attn_v_b are halves of self_attn.kv_b_proj

    def hf_architecture(self, n_experts: int) -> str:
        return self.moe_hf if n_experts and self.moe_hf else self.hf


def _experts(module: str, gate: str, up: str, down: str) -> dict[str, str]:
    return {"ffn_gate_exps": f"{module}.experts.{{e}}.{gate}", "ffn_up_exps": f"{module}.experts.{{e}}.{up}",
            "ffn_down_exps": f"{module}.experts.{{e}}.{down}"}


ARCHS = {
    "llama": Arch("LlamaForCausalLM", moe_hf="MixtralForCausalLM", router="block_sparse_moe.gate",
                  experts=_experts("block_sparse_moe", "w1", "w3", "w2"), permuted_qk=True),
    "mistral": Arch("MistralForCausalLM", permuted_qk=True),
    "qwen2": Arch("Qwen2ForCausalLM"),
    "qwen3": Arch("Qwen3ForCausalLM"),
    "gemma2": Arch("Gemma2ForCausalLM", _GEMMA_NAMES, norm_shift=1.0),
    "gemma3": Arch("Gemma3ForCausalLM", _GEMMA_NAMES, norm_shift=1.0),
    "phi3": Arch("Phi3ForCausalLM", _PHI3_NAMES, partial_rotary=True),
    "qwen3moe": Arch("Qwen3MoeForCausalLM", router="mlp.gate",
                     experts=_experts("mlp", "gate_proj", "up_proj", "down_proj")),
    "glm4moe": Arch("Glm4MoeForCausalLM", _GLM_NAMES, moe_hf="Glm4MoeForCausalLM", router="mlp.gate",
                    experts=_experts("mlp", "gate_proj", "up_proj", "down_proj"),
                    score_bias="mlp.gate.e_score_correction_bias", partial_rotary=True),
    "minimax-m2": Arch("MiniMaxM2ForCausalLM", moe_hf="MiniMaxM2ForCausalLM", router="block_sparse_moe.gate",
                       experts=_experts("block_sparse_moe", "w1", "w3", "w2"),
                       score_bias="block_sparse_moe.e_score_correction_bias", partial_rotary=True),
    "deepseek2": Arch("DeepseekV3ForCausalLM", _MLA_NAMES, moe_hf="DeepseekV3ForCausalLM", router="mlp.gate",
                      experts=_experts("mlp", "gate_proj", "up_proj", "down_proj"),
                      score_bias="mlp.gate.e_score_correction_bias", partial_rotary=True, kv_b_parts=True),
}
NOT_WEIGHTS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_SPLIT_EXPERT = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight$")   # old Mixtral files
_NEXTN = re.compile(r"^blk\.(\d+)\.nextn\.([a-z_]+)\.weight$")      # GLM's next-token-prediction layer
LARGE_GEMMA_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models: llama.cpp scales queries by hidden / heads


@dataclass(frozen=True)
class Piece:
    """A Hub-named tensor's place in the file: the GGUF tensor, and the expert it is of a merged one (None:
    the whole tensor)."""

    gguf: str
    expert: int | None = None
    part: str | None = None               # "k" / "v": a half of a tensor llama.cpp stores split (join_kv_b)


def hub_names(gguf_name: str, arch: str, n_experts: int) -> dict[str, Piece] | None:
    """The Hub tensor name(s) a GGUF tensor of `arch` holds (a merged expert tensor holds n_experts of them), or
    None when it is no tensor of the decoder or of `arch`'s experts (n_experts 0: a dense file)."""
    if gguf_name in GLOBAL_NAMES:
        return {GLOBAL_NAMES[gguf_name]: Piece(gguf_name)}
    table = ARCHS[arch]
    split = _SPLIT_EXPERT.match(gguf_name)
    if split is not None:
        if not n_experts or not table.moe_hf:
            return None
        layer, proj, e = split.groups()
        return {f"model.layers.{layer}.{table.experts[f'{proj}_exps'].format(e=e)}.weight": Piece(gguf_name)}
    nextn = _NEXTN.match(gguf_name)
    if nextn is not None:                   # read as the layer after the decoder, which the model leaves unread
        return {f"model.layers.{nextn.group(1)}.nextn.{nextn.group(2)}.weight": Piece(gguf_name)}
    m = _BLOCK.match(gguf_name)
    if m is None:
        return None
    layer, kind, suffix = m.groups()
    head = f"model.layers.{layer}."
    if kind == "exp_probs_b" and suffix == "bias" and table.score_bias:
        return {f"{head}{table.score_bias}": Piece(gguf_name)}
    if kind in table.block:
        return {f"{head}{table.block[kind]}.{suffix}": Piece(gguf_name)}
    if table.kv_b_parts and kind in KV_B_PARTS and suffix == "weight":
        return {f"{head}self_attn.kv_b_proj.weight": Piece(gguf_name, part=KV_B_PARTS[kind])}
    if not n_experts or table.router is None or suffix != "weight":
        return None
    if kind == "ffn_gate_inp":
        return {f"{head}{table.router}.weight": Piece(gguf_name)}
    if kind in table.experts:
        return {f"{head}{table.experts[kind].format(e=e)}.weight": Piece(gguf_name, e) for e in range(n_experts)}
    return None


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """DeepSeek's kv_b_proj [H * (nope + v), r] from llama.cpp's halves: k_b [H, r, nope] (each head's key rows,
    transposed) and v_b [H, v, r]; per head its nope key rows, then its v value rows."""
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1]).contiguous()


@dataclass(frozen=True)
class JoinedKV:
    """A tensor llama.cpp stores as two (deepseek2's kv_b_proj as attn_k_b and attn_v_b, each a gguf.TensorInfo):
    read both, join_kv_b."""

    k: Any
    v: Any

    @property
    def name(self) -> str:
        return f"{self.k.name} + {self.v.name}"

    @property
    def qtype(self) -> int:
        return self.k.qtype

    @property
    def shape(self) -> tuple[int, int]:
        k, v = self.k.shape, self.v.shape
        return (k[0] * (k[2] + v[1]), k[1])


def joined_kv_b(path: Any, target: str, halves: dict[str, Any]) -> JoinedKV:
    """kv_b_proj from one layer's attn_k_b [H, r, nope] and attn_v_b [H, v, r] (torch shapes), or
    CheckpointError naming what does not fit."""
    if set(halves) != {"k", "v"}:
        have = ", ".join(i.name for i in halves.values())
        raise CheckpointError(f"{path}: {have} without its other half (attn_k_b and attn_v_b make {target} together)")
    k, v = halves["k"].shape, halves["v"].shape
    if len(k) != 3 or len(v) != 3 or k[0] != v[0] or k[1] != v[2]:
        raise CheckpointError(f"{path}: {halves['k'].name} {list(k)} and {halves['v'].name} {list(v)} are not the "
                              "halves of one kv_b_proj ([heads, kv_lora_rank, nope] and [heads, v, kv_lora_rank])")
    return JoinedKV(halves["k"], halves["v"])


# config.json key -> the GGUF metadata key (after "<arch>.") `GGUFCheckpoint.config` reads it from: how a bad value
# is named (GGUFCheckpoint.config_names)
METADATA_KEYS = {
    "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
    "hidden_size": "embedding_length", "num_hidden_layers": "block_count", "intermediate_size": "feed_forward_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length", "head_dim": "attention.key_length", "num_experts": "expert_count",
    "num_local_experts": "expert_count", "n_routed_experts": "expert_count", "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length", "n_shared_experts": "expert_shared_count",
    "first_k_dense_replace": "leading_dense_block_count", "routed_scaling_factor": "expert_weights_scale",
    "n_group": "expert_group_count", "topk_group": "expert_group_used_count",
    "num_nextn_predict_layers": "nextn_predict_layers", "kv_lora_rank": "attention.kv_lora_rank",
    "q_lora_rank": "attention.q_lora_rank", "qk_rope_head_dim": "rope.dimension_count",
    "rotary_dim": "rope.dimension_count", "v_head_dim": "attention.value_length",
    "sliding_window": "attention.sliding_window", "final_logit_softcapping": "final_logit_softcapping",
    "attn_logit_softcapping": "attn_logit_softcapping",
}
ARCH_METADATA_KEYS = {"minimax-m2": {"intermediate_size": "expert_feed_forward_length"},
                      "deepseek2": {"head_dim": "attention.key_length_mla", "v_head_dim": "attention.value_length_mla"}}


def head_dim_of(ckpt: Any, heads: int, kv: int) -> int:
    """Rows per head of the query projection (the fused qkv's split for Phi-3), unless key_length says; for
    deepseek2, the query's head (nope + rope: key_length_mla, or key_length in files written before MLA's)."""
    if ckpt.arch == "deepseek2":
        return int(ckpt._meta("attention.key_length_mla", None) or ckpt._meta("attention.key_length"))
    if ckpt.arch == "phi3":
        rows = ckpt.shape("model.layers.0.self_attn.qkv_proj.weight")[0] // (heads + 2 * kv)
    else:
        rows = ckpt.shape("model.layers.0.self_attn.q_proj.weight")[0] // heads
    return int(ckpt._meta("attention.key_length", rows))


def arch_config(ckpt: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """The config.json keys of `ckpt`'s architecture beyond the shared ones in `cfg` (a GGUFCheckpoint:
    arch, n_experts, _meta(key, default), shape(name), rope factor tensors)."""
    arch = ckpt.arch
    if arch == "glm4moe":
        return _glm_config(ckpt, cfg)
    if arch == "deepseek2":
        return _deepseek_config(ckpt, cfg)
    if arch == "minimax-m2":
        return {**_expert_config(ckpt, cfg), "rotary_dim": int(ckpt._meta("rope.dimension_count")),
                "intermediate_size": int(ckpt._meta("expert_feed_forward_length", cfg["intermediate_size"]))}
    if ckpt.n_experts:
        return _expert_config(ckpt, cfg)
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


def _expert_config(ckpt: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """An MoE file's experts: the count, how many a token uses, their width, and which layers are dense (no
    router). llama.cpp renormalises the kept weights of both Mixtral and Qwen3-MoE (norm_w = true)."""
    dense = [i for i in range(cfg["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in ckpt._raw]
    return dict(num_experts=ckpt.n_experts, num_local_experts=ckpt.n_experts, norm_topk_prob=True,
                mlp_only_layers=dense, num_experts_per_tok=int(ckpt._meta("expert_used_count")),
                moe_intermediate_size=int(ckpt._meta("expert_feed_forward_length", cfg["intermediate_size"])))


def _glm_config(ckpt: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5's config.json keys from a glm4moe file: llama.cpp counts the next-token-prediction layers in
    block_count; its routing (sigmoid with a score bias, groups, scale), shared experts, dense first layers,
    partial rotary, q/k norms and q/k/v biases where the file has them."""
    nextn = int(ckpt._meta("nextn_predict_layers", 0))
    return dict(num_hidden_layers=cfg["num_hidden_layers"] - nextn, num_nextn_predict_layers=nextn,
                n_routed_experts=ckpt.n_experts, num_experts_per_tok=int(ckpt._meta("expert_used_count")),
                moe_intermediate_size=int(ckpt._meta("expert_feed_forward_length")),
                n_shared_experts=int(ckpt._meta("expert_shared_count", 0)),
                first_k_dense_replace=int(ckpt._meta("leading_dense_block_count", 0)),
                routed_scaling_factor=float(ckpt._meta("expert_weights_scale", 1.0)),
                norm_topk_prob=bool(ckpt._meta("expert_weights_norm", True)),
                n_group=int(ckpt._meta("expert_group_count", 1)),
                topk_group=int(ckpt._meta("expert_group_used_count", 1)),
                partial_rotary_factor=int(ckpt._meta("rope.dimension_count")) / cfg["head_dim"],
                use_qk_norm="model.layers.0.self_attn.q_norm.weight" in ckpt._where,
                attention_bias="model.layers.0.self_attn.q_proj.bias" in ckpt._where)


GATING = {1: "softmax", 2: "sigmoid"}         # llama.cpp's expert_gating_func; absent in a deepseek2 file: softmax


def _deepseek_config(ckpt: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's config.json keys from a deepseek2 file (DeepSeek-V3/R1/V3.1, Kimi-K2: sigmoid gating). The
    latent ranks, the query's nope/rope split and the value head (key/value_length_mla; files written before
    llama.cpp's MLA keys store them as key/value_length), routing as llama.cpp reads it (groups, scale, and
    weights renormalised only where the file says so), YaRN with mscale = mscale_all_dim = yarn_log_multiplier /
    0.1 (GGUF keeps only the latter; the published checkpoints set both to 1). A softmax-gated file is
    DeepSeek-V2 / V2.5, which this runtime does not run: refused."""
    gating = int(ckpt._meta("expert_gating_func", 1))
    if GATING.get(gating) != "sigmoid":
        raise CheckpointError(f"{ckpt.path}: a deepseek2 file with {GATING.get(gating, f'type {gating}')} expert "
                              "gating is DeepSeek-V2 / V2.5, which this runtime does not run; supported: "
                              "DeepSeek-V3, R1, V3.1 and Kimi-K2 files (sigmoid gating)")
    rope_dim = int(ckpt._meta("rope.dimension_count"))
    mla = ckpt._meta("attention.key_length_mla", None) is not None
    v_dim = int(ckpt._meta("attention.value_length_mla" if mla else "attention.value_length"))
    q_rank = ckpt._meta("attention.q_lora_rank", None)
    extra = dict(n_routed_experts=ckpt.n_experts, num_experts_per_tok=int(ckpt._meta("expert_used_count")),
                 moe_intermediate_size=int(ckpt._meta("expert_feed_forward_length")),
                 n_shared_experts=int(ckpt._meta("expert_shared_count", 0)),
                 first_k_dense_replace=int(ckpt._meta("leading_dense_block_count", 0)),
                 routed_scaling_factor=float(ckpt._meta("expert_weights_scale", 1.0)),
                 norm_topk_prob=bool(ckpt._meta("expert_weights_norm", False)), scoring_func="sigmoid",
                 n_group=int(ckpt._meta("expert_group_count", 1)),
                 topk_group=int(ckpt._meta("expert_group_used_count", 1)),
                 kv_lora_rank=int(ckpt._meta("attention.kv_lora_rank")), q_lora_rank=int(q_rank) if q_rank else None,
                 qk_rope_head_dim=rope_dim, qk_nope_head_dim=cfg["head_dim"] - rope_dim, v_head_dim=v_dim,
                 rope_interleave=True, num_key_value_heads=cfg["num_attention_heads"])
    scaling = cfg["rope_scaling"]
    if scaling and scaling["rope_type"] == "yarn":
        mscale = round(float(ckpt._meta("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)   # a float32 in the file
        extra["rope_scaling"] = {**scaling, "original_max_position_embeddings": int(ckpt._meta(
            "rope.scaling.original_context_length")), "mscale": mscale, "mscale_all_dim": mscale,
            "beta_fast": float(ckpt._meta("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(ckpt._meta("rope.scaling.yarn_beta_slow", 1.0))}
    return extra
