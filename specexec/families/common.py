"""config.json fields families read the same way: the decoder's shape, RoPE base and scaling, special token ids
(a family module starts from `base_fields(cfg)` and sets its own options on top); and the sigmoid-routed mixture
of experts that DeepSeek-V3, GLM-4.5+ and Kimi-K2 share (`grouped_sigmoid_moe`): n_routed_experts experts of
moe_intermediate_size, num_experts_per_tok chosen per token by sigmoid scores plus e_score_correction_bias,
limited to the topk_group best of n_group groups, renormalised when norm_topk_prob, scaled by
routed_scaling_factor; n_shared_experts shared experts (one gated MLP of n_shared_experts x
moe_intermediate_size); the first first_k_dense_replace layers dense; the next-token-prediction layers stored
after the decoder (`mtp_layers`), which the target skips. Contradicting fields are refused with one line naming
the config.json field (not ModelArgs' name for it).

Does not know: which family a config is (registry.py), the network (specexec/network/moe.py), checkpoints'
tensor names (each family's WEIGHT_RULES).
"""
from __future__ import annotations

from typing import Any

from specexec.config import LAYER_TYPES, MoEArgs
from specexec.options import ConfigError

ROPE_KINDS = ("default", "llama3", "linear")


def base_fields(cfg: dict[str, Any], rope_kinds: tuple[str, ...] = ROPE_KINDS) -> dict[str, Any]:
    """ModelArgs keyword arguments shared by every family (shape, norm eps, RoPE, ids, tied embeddings);
    `rope_kinds`: the RoPE scalings the family's checkpoints may name."""
    n_heads = int(cfg["num_attention_heads"])
    dim = int(cfg["hidden_size"])
    rope = cfg.get("rope_parameters") or {}          # transformers >= 5 folds rope_theta in here
    return dict(
        vocab_size=int(cfg["vocab_size"]),
        dim=dim,
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or dim // n_heads),
        intermediate_size=int(cfg["intermediate_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=rope_scaling(cfg, rope_kinds),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg),
    )


def rope_scaling(cfg: dict[str, Any], kinds: tuple[str, ...] = ROPE_KINDS) -> tuple[tuple[str, Any], ...] | None:
    """The frozen form of config.json's rope scaling (rope_scaling, or transformers 5's rope_parameters when
    not default); ConfigError for a kind outside `kinds`."""
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in kinds:
        raise ConfigError(f"unsupported rope scaling {kind!r}; supported: {', '.join(kinds)}")
    return tuple(sorted((k, v) for k, v in scaling.items() if not isinstance(v, (list, dict)))) or None


def eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    """config.json's eos_token_id (an int, a list or absent) as a tuple."""
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def sliding_window(cfg: dict[str, Any], default_on: bool) -> int | None:
    """config.json's sliding window when it applies: `use_sliding_window` (default `default_on`: Mistral and
    Mixtral have no such key and always use their window; Qwen's default is off)."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", default_on) else None
    return int(window) if window else None


def check_activation(cfg: dict[str, Any], family: str, supported: tuple[str, ...] = ("silu",)) -> None:
    """ConfigError unless the MLP's hidden_act (default silu) is one the network computes."""
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in supported:
        raise ConfigError(f"{family} with hidden_act {act!r} is not supported; supported: {', '.join(supported)}")


def n_experts(cfg: dict[str, Any]) -> int:
    """The routed experts per MoE layer: num_experts (the Hub's Qwen and OLMoE configs) or num_local_experts
    (Mixtral, gpt-oss, and what transformers >= 5 writes for every one of them); 0 when neither is set."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def layer_types(cfg: dict[str, Any], default: Any = None) -> tuple[str, ...]:
    """config.json's per-layer attention kinds (layer_types), else `default(i)` for each layer (None: ());
    ConfigError for a kind outside LAYER_TYPES (a recurrent one: the hybrid line of `recurrent_reason`)."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        return tuple(default(i) for i in range(n)) if default is not None else ()
    odd = sorted({t for t in types if t not in LAYER_TYPES})
    if odd:
        why = recurrent_reason(cfg)
        raise ConfigError(why or f"layer_types {', '.join(odd)} are not supported; supported: {', '.join(LAYER_TYPES)}")
    return tuple(types)


# Architectures whose layers (some or all) are of a kind specexec does not run -> that kind: state-space (Mamba),
# other linear attentions (Kimi Delta Attention, lightning, GLM-5-Next's), RNN-style (RWKV, RG-LRU), short
# convolutions (LFM2), indexed sparse attention (Qwen4-exp, GLM-5-Next). Gated DeltaNet (Qwen3-Next, Qwen3.5) runs.
MISSING_KINDS = {
    "JambaForCausalLM": "Mamba", "MambaForCausalLM": "Mamba", "Mamba2ForCausalLM": "Mamba-2",
    "FalconMambaForCausalLM": "Mamba", "Zamba2ForCausalLM": "Mamba-2", "ZambaForCausalLM": "Mamba",
    "BambaForCausalLM": "Mamba-2", "FalconH1ForCausalLM": "Mamba-2", "NemotronHForCausalLM": "Mamba-2",
    "GraniteMoeHybridForCausalLM": "Mamba-2", "RecurrentGemmaForCausalLM": "RG-LRU recurrence",
    "RwkvForCausalLM": "RWKV recurrence", "Lfm2ForCausalLM": "short-convolution",
    "Lfm2MoeForCausalLM": "short-convolution", "MiniMaxForCausalLM": "lightning linear attention",
    "MiniMaxText01ForCausalLM": "lightning linear attention",
    "KimiLinearForCausalLM": "Kimi Delta Attention linear attention",
    "Glm5NextForConditionalGeneration": "GLM-5-Next linear attention and indexed sparse attention",
    "Qwen4ExpForCausalLM": "indexed sparse attention", "Qwen4ExpForConditionalGeneration": "indexed sparse attention",
    "OlmoHybridForCausalLM": "OLMo-hybrid Gated DeltaNet",
}
_RECURRENT_KEYS = ("mamba_d_state", "ssm_state_size", "mamba_expand", "linear_num_value_heads", "conv_L_cache")
RUNS = "full and sliding attention, and Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5)"


# Architectures whose attention specexec does not compute: it runs full, sliding-window and latent attention.
SPARSE_ATTENTION = {
    "DeepseekV32ForCausalLM": "DeepSeek sparse attention (a lightning indexer picks the keys each query sees)",
    "GlmMoeDsaForCausalLM": "DeepSeek sparse attention (a lightning indexer picks the keys each query sees)",
    "DeepseekV4ForCausalLM": "compressed sparse attention (keys compressed and picked per query)",
}


def sparse_attention_reason(cfg: dict[str, Any]) -> str | None:
    """The line for an architecture of SPARSE_ATTENTION (naming its attention kind), else None."""
    archs = cfg.get("architectures") or []
    what = next((SPARSE_ATTENTION[a] for a in archs if a in SPARSE_ATTENTION), None)
    if what is None:
        return None
    return (f"unsupported architecture {', '.join(archs)}: its attention is {what}, which this runtime does not "
            "compute (it runs full, sliding-window and latent attention exactly)")


def recurrent_reason(cfg: dict[str, Any]) -> str | None:
    """The line for a model with layers of a kind specexec does not run (an architecture of MISSING_KINDS, a
    layer_types kind outside LAYER_TYPES, or state-space config keys), else None."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    archs = cfg.get("architectures") or []
    kinds = sorted({t for t in (cfg.get("layer_types") or text.get("layer_types") or []) if t not in LAYER_TYPES})
    what = next((MISSING_KINDS[a] for a in archs if a in MISSING_KINDS), None)
    if what is None and kinds:
        what = " / ".join(kinds).replace("_", " ")
    if what is None and any(k in cfg or k in text for k in _RECURRENT_KEYS):
        what = "state-space"
    if what is None:
        return None
    name = ", ".join(archs) or f"model_type={cfg.get('model_type')!r}"
    return f"unsupported architecture {name}: its {what} layers are a layer kind specexec does not run (it runs {RUNS})"


def grouped_sigmoid_moe(cfg: dict[str, Any]) -> MoEArgs:
    """MoEArgs of a DeepSeek-V3-style config; ConfigError naming the field for contradicting routing fields."""
    experts = _count(cfg, "n_routed_experts", cfg.get("n_routed_experts") or cfg.get("num_local_experts"))
    top_k = _count(cfg, "num_experts_per_tok", cfg["num_experts_per_tok"])
    groups = _count(cfg, "n_group", cfg.get("n_group") or 1)
    topk_group = _count(cfg, "topk_group", cfg.get("topk_group") or 1)
    layers = int(cfg["num_hidden_layers"])
    dense = int(cfg.get("first_k_dense_replace") or 0)
    if topk_group > groups:
        raise ConfigError(f"config.json's topk_group {topk_group} is above n_group {groups}: a token cannot use "
                          "more expert groups than there are")
    if experts % groups:
        raise ConfigError(f"config.json's n_routed_experts {experts} does not split into n_group {groups} equal groups")
    if top_k > experts // groups * topk_group:
        raise ConfigError(f"config.json's num_experts_per_tok {top_k} is above the {experts // groups * topk_group} "
                          f"experts a token may reach (n_routed_experts {experts} in n_group {groups}, topk_group "
                          f"{topk_group})")
    if groups > 1 and experts // groups < 2:
        raise ConfigError(f"config.json's n_group {groups} leaves {experts // groups} expert per group; a group "
                          "is scored by its two best experts")
    if not 0 <= dense <= layers:
        raise ConfigError(f"config.json's first_k_dense_replace {dense} is not within the {layers} layers")
    method = cfg.get("topk_method", "noaux_tc")
    scoring = cfg.get("scoring_func", "sigmoid")
    if method != "noaux_tc" or scoring != "sigmoid":
        raise ConfigError(f"config.json's routing (topk_method {method!r}, scoring_func {scoring!r}) is not the "
                          "sigmoid noaux_tc routing this family runs")
    shared = int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"])
    return MoEArgs(n_experts=experts, top_k=top_k, expert_dim=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), router="sigmoid", score_bias=True,
                   n_group=groups, topk_group=topk_group,
                   routed_scale=float(cfg.get("routed_scaling_factor") or 1.0), router_fp32=True,
                   shared_dim=shared, dense_layers=tuple(range(dense)))


def mtp_layers(cfg: dict[str, Any]) -> int:
    """Next-token-prediction layers stored after the last decoder layer (num_nextn_predict_layers, transformers'
    num_mtp_layers): the target never runs them; their tensors are left unread."""
    return int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers")) or 0)


def _count(cfg: dict[str, Any], name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json's {name} must be a positive integer, got {value!r}")
    return value
