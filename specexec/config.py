"""Frozen configuration built once at the edge: the model's shape, how tokens are sampled, how the engine and
the offloaded target run.

ModelArgs comes from a checkpoint's config.json; SamplingParams, EngineConfig and OffloadConfig from CLI flags
(or a server request, or models.yaml). Each validates itself on construction with the checks of
specexec/options.py, so a config that exists is a valid one and callers never re-validate.

Does not know: how a value was typed (options.py parses text), how weights are loaded or anything about trees.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from specexec.options import (
    DTYPES, MAX_BUDGET, ConfigError, check_choice, check_draft_vocab, check_integer, check_number, choices,
    parse_draft_layers, parse_size)


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelArgs:
    """Shape and maths options of one Llama-family decoder (Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3)."""

    family: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None   # frozen form of HF's rope_scaling dict
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        """Build from a parsed config.json; raises ConfigError for architectures outside the family."""
        archs = cfg.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            shown = ", ".join(archs) or f"model_type={cfg.get('model_type')!r}"
            raise ConfigError(f"unsupported architecture {shown}; supported: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            return cls._from_family(family, cfg)
        except KeyError as e:
            raise ConfigError(f"config.json lacks the field {e.args[0]!r} needed for a {family} model") from None

    @classmethod
    def _from_family(cls, family: str, cfg: dict[str, Any]) -> "ModelArgs":
        n_heads = int(cfg["num_attention_heads"])
        dim = int(cfg["hidden_size"])
        rope = cfg.get("rope_parameters") or {}          # transformers >= 5 folds rope_theta in here
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "llama3", "linear"):
                raise ConfigError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
            scaling = tuple(sorted((k, v) for k, v in scaling.items() if not isinstance(v, (list, dict))))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", family == "mistral") else None
        return cls(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            dim=dim,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or dim // n_heads),
            intermediate_size=int(cfg["intermediate_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=scaling or None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass(frozen=True)
class SamplingParams:
    """How one token is chosen from the (processed) logits. temperature 0 means greedy.

    repetition_penalty (HF) reads the whole context; presence_penalty and frequency_penalty (OpenAI, in
    [-2, 2]) read only the tokens generated by this request. specexec.sampling.process_logits applies them."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        check_number("temperature", self.temperature, low=0.0, high=100.0)
        check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        check_integer("top_k", self.top_k, low=0, high=10**7)
        check_number("min_p", self.min_p, low=0.0, high=1.0)
        check_number("repetition_penalty", self.repetition_penalty, low=0.0, high=100.0, low_open=True)
        check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            check_integer("seed", self.seed, low=0, high=2**63 - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """Whether processing the logits reads the tokens before them (a history-dependent penalty is set)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: tree budget and builder, device and dtype. Validated on construction."""

    budget: int = 64                # the tree budget, or with auto_budget the largest budget tried
    auto_budget: bool = False       # --budget auto: specexec.tuning.budget picks each step's budget
    builder: str = "specexec"
    device: str = "cpu"
    dtype: str = "auto"
    max_new_tokens: int = 128
    prefill_chunk: int | None = None   # prompt tokens per prefill pass; None: 512, or a streamed target's plan
    verifier: str = "auto"
    builder_options: tuple[tuple[str, Any], ...] = field(default=())
    draft_vocab: int | str | None = None   # VocabTrim: the draft head keeps N target-frequent tokens, or "auto"
    kv_quant: str = "none"          # --kv-quant: "int8" stores KV rows quantized (LOSSY; never in an exactness claim)

    def __post_init__(self) -> None:
        check_number("budget", self.budget, low=1, high=MAX_BUDGET)
        check_choice("--kv-quant", self.kv_quant, choices("--kv-quant"))
        check_draft_vocab(self.draft_vocab)
        check_number("max_new_tokens", self.max_new_tokens, low=1, high=10**7)
        if self.prefill_chunk is not None:
            check_integer("prefill_chunk", self.prefill_chunk, low=1, high=10**6)
        check_choice("builder", self.builder, choices("--builder"))
        check_choice("verifier", self.verifier, choices("--verifier"))
        check_choice("dtype", self.dtype, DTYPES)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"unknown device {self.device!r}; use cpu or cuda")

    def replace(self, **changes: Any) -> "EngineConfig":
        known = {f.name for f in fields(self)}
        bad = set(changes) - known
        if bad:
            raise ConfigError(f"unknown engine option(s): {', '.join(sorted(bad))}")
        return type(self)(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})


@dataclass(frozen=True)
class OffloadConfig:
    """Where the target's decoder layers live and how they are stored. Validated on construction.

    quant: target layer format; auto = none while every layer stays resident, and once any layer streams int4 on
    a CPU (specexec's integer int4 kernel), nf4 on CUDA (offload.quant.weights.auto_format).
    draft_quant: the (always resident) draft's linear layers (none: the run dtype, fp32 on a CPU).
    offload: auto = the planner decides from the budgets; none / ram / ssd put every target layer resident / in
    pinned RAM / in the on-disk cache.
    gpu_budget, ram_budget: bytes (None: what is free now minus a margin). cache_dir: layer cache root (None:
    $SPECEXEC_CACHE or ~/.cache/specexec). context: tokens (prompt + answer) the memory plan reserves KV cache
    for (None: 4096, at most the model's maximum; longer conversations grow the caches beyond the plan).
    kv_offload: where the target's KV rows live: auto = the planner decides per streamed layer (on the device,
    or in host RAM travelling with the layer when the device runs short); device = always on the device;
    stream = every streamed layer's rows travel with it (also on a CPU, where it only costs a copy).
    draft_layers: with --draft self, how many of the target's decoder layers the draft runs (None or "auto":
    the most the budget holds; specexec/runtime/self_draft.py)."""

    quant: str = "auto"
    draft_quant: str = "none"
    offload: str = "auto"
    gpu_budget: int | None = None
    ram_budget: int | None = None
    cache_dir: str | None = None
    context: int | None = None
    kv_offload: str = "auto"
    draft_layers: int | str | None = None        # --draft self: decoder layers the draft runs (None/auto: planned)

    def __post_init__(self) -> None:
        check_choice("--kv-offload", self.kv_offload, choices("--kv-offload"))
        if self.context is not None:
            check_integer("--context", self.context, low=16, high=10**7)
        if self.draft_layers is not None and self.draft_layers != "auto":
            check_integer("--draft-layers", self.draft_layers, low=1, high=10**5)
        for flag, value in (("--quant", self.quant), ("--draft-quant", self.draft_quant),
                            ("--offload", self.offload)):
            if value not in choices(flag):
                raise ConfigError(f"{flag} {value!r} is not one of: {', '.join(choices(flag))}")
        for flag, value in (("--gpu-budget", self.gpu_budget), ("--ram-budget", self.ram_budget)):
            if value is not None:
                check_number(flag, value, low=1, high=2**62)
        if self.cache_dir is not None and not str(self.cache_dir).strip():
            raise ConfigError("--cache-dir is empty; pass a directory or leave it out")

    @classmethod
    def from_flags(cls, quant: str | None = None, draft_quant: str | None = None, offload: str | None = None,
                   gpu_budget: str | None = None, ram_budget: str | None = None,
                   cache_dir: str | None = None, context: int | None = None,
                   kv_offload: str | None = None, draft_layers: str | None = None) -> "OffloadConfig":
        """From command-line strings (None = default); sizes like 20GB, 512MiB."""
        kw: dict[str, Any] = {k: v for k, v in (("quant", quant), ("draft_quant", draft_quant),
                                                 ("offload", offload), ("cache_dir", cache_dir),
                                                 ("context", context), ("kv_offload", kv_offload)) if v is not None}
        if draft_layers is not None:
            kw["draft_layers"] = parse_draft_layers(draft_layers)
        if gpu_budget is not None:
            kw["gpu_budget"] = parse_size(gpu_budget, "--gpu-budget")
        if ram_budget is not None:
            kw["ram_budget"] = parse_size(ram_budget, "--ram-budget")
        return cls(**kw)


def with_field(obj: Any, name: str, text: str) -> Any:
    """A copy of the frozen dataclass `obj` with field `name` parsed from `text` ('none' for an optional
    field), validated by the dataclass itself. For `/set temperature 0.7` and the like."""
    known = {f.name: str(f.type) for f in fields(obj)}
    key = name.strip().replace("-", "_")
    if key not in known:
        raise ConfigError(f"unknown setting {name!r}; settable: {', '.join(known)}")
    kind, raw = known[key], text.strip()
    if raw.lower() in ("none", "null") and "None" in kind:
        value: Any = None
    elif kind.startswith("int"):
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{key} must be an integer, got {raw!r}") from None
    elif kind.startswith("float"):
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{key} must be a number, got {raw!r}") from None
    elif kind.startswith("str"):
        value = raw
    else:
        raise ConfigError(f"{key} cannot be set from text")
    return type(obj)(**{**{f.name: getattr(obj, f.name) for f in fields(obj)}, key: value})
