"""config.json fields every family reads the same way: the decoder's shape, RoPE base and scaling, special
token ids. A family module starts from `base_fields(cfg)` and sets its own options on top.

Does not know: which family a config is (registry.py), the network.
"""
from __future__ import annotations

from typing import Any

from specexec.config import LAYER_TYPES
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
    ConfigError for a kind outside LAYER_TYPES (registry.refusal words the line for hybrid models)."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        return tuple(default(i) for i in range(n)) if default is not None else ()
    odd = sorted({t for t in types if t not in LAYER_TYPES})
    if odd:
        raise ConfigError(f"layer_types {', '.join(odd)} are not supported; supported: {', '.join(LAYER_TYPES)}")
    return tuple(types)
