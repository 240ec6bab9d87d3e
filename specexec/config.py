"""Frozen configuration built once at the edge, and the ONE place where user input is validated.

ModelArgs comes from a checkpoint's config.json; SamplingParams and EngineConfig from CLI flags (or a server
request, or models.yaml). Every check of a user-supplied value lives here and raises ConfigError with the
offending value and what to do instead; callers never re-validate. The names a choice flag accepts
(--builder, --verifier, --quant, --offload, ...) are not listed here: `choices(flag)` reads each from the
registry that owns it (builders.registry, verify.RULES, offload's quant formats and planner modes), lazily
where that registry imports this module or torch.

Does not know: how weights are loaded or anything about trees; which devices exist only in check_device,
which asks torch lazily.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from offload import planner

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class ConfigError(ValueError):
    """A user-facing configuration problem; the message is one line saying what is wrong and what to do."""


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


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str, what: str = "size") -> int:
    """'48GB' -> 48e9 bytes, '512MiB' -> 512*2**20, '1.5G' -> 1.5e9. Raises ConfigError for anything else."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{what}: {text!r} is not a size; write it like 48GB, 512MB or 1.5GiB")
    unit = (m.group(2) or "").lower().rstrip("b")
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ConfigError(f"{what}: {text!r} must be larger than zero")
    return int(value)


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


def check_number(name: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    """Raise ConfigError unless value is a finite number in [low, high] (or (low, high] when low_open)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ConfigError(f"{name} must be in {bracket}{low}, {high}], got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ConfigError unless value is one of choices (named in the message)."""
    if value not in choices:
        raise ConfigError(f"unknown {name} {value!r}; choose one of: {', '.join(choices)}")


def _builders() -> tuple[str, ...]:
    from specexec.builders.registry import names      # lazy: the builders import this module
    return names()


def _verifiers() -> tuple[str, ...]:
    from specexec.verify import RULES                  # lazy: verify imports this module
    return ("auto", *RULES)


def _quant_formats() -> tuple[str, ...]:
    from offload.quant.linear import FORMATS           # lazy: keeps torch out of this module's import
    return tuple(FORMATS)


def _kv_quants() -> tuple[str, ...]:
    from specexec.kv.rows import QUANTS                # lazy: keeps torch out of this module's import
    return tuple(QUANTS)


# Choice flag -> where its accepted values are registered. Flags, --help text, validation and error messages
# all call choices(); no other module lists these names.
_CHOICES: dict[str, Callable[[], tuple[str, ...]]] = {
    "--builder": _builders,                            # specexec.builders.registry (@register)
    "--verifier": _verifiers,                          # specexec.verify.RULES, plus auto (the builder's own)
    "--dtype": lambda: DTYPES,
    "--kv-quant": _kv_quants,                          # specexec.kv.rows.QUANTS
    "--quant": lambda: ("auto", *_quant_formats()),    # offload.quant.linear.FORMATS, plus auto
    "--draft-quant": _quant_formats,
    "--offload": lambda: planner.OFFLOAD_MODES,
    "--kv-offload": lambda: planner.COMPANION_MODES,   # where streamed layers' KV rows live
}


def choices(flag: str) -> tuple[str, ...]:
    """The accepted values of a choice flag ("--builder", "--quant", ...), read from the registry that owns
    them; KeyError for a flag that has no registry."""
    return _CHOICES[flag]()


def choices_help(flag: str) -> str:
    """choices(flag) as --help text writes them: 'a | b | c'."""
    return " | ".join(choices(flag))


def check_integer(name: str, value: Any, low: int, high: int) -> None:
    """Raise ConfigError unless value is an integer (not a bool, not 2.5) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    check_number(name, value, low=low, high=high)


DTYPES = ("auto", "float32", "bfloat16", "float16")     # the run dtype; loading.DTYPES maps these to torch
MAX_BUDGET = 16384
AUTO_MAX_BUDGET = 1024              # the largest tree --budget auto tries unless --max-budget says otherwise


def budget_options(value: str | int | None, max_budget: int | None = None) -> dict[str, Any]:
    """--budget N|auto -> EngineConfig keywords ({} when not given). 'auto' searches up to max_budget."""
    if value is None:
        return {}
    if str(value).strip().lower() == "auto":
        top = AUTO_MAX_BUDGET if max_budget is None else max_budget
        check_number("--max-budget", top, low=1, high=MAX_BUDGET)
        return {"budget": top, "auto_budget": True}
    try:
        return {"budget": int(str(value).strip())}
    except ValueError:
        raise ConfigError(f"--budget {value!r} is not a number of tree tokens or 'auto'") from None


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
    a CPU (torch's fused int4 kernel), nf4 on CUDA (offload.quant.linear.auto_format).
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


SELF_DRAFT = "self"           # --draft self[:FORMAT]: the target drafts with its own layers (runtime/self_draft.py)


def is_self_draft(spec: str | None) -> bool:
    """Whether a --draft value (or a models.yaml drafts item) names the self-draft: "self" or "self:FORMAT"."""
    return spec is not None and (spec.strip() == SELF_DRAFT or spec.strip().startswith(SELF_DRAFT + ":"))


def parse_draft_layers(text: str | int) -> int | str:
    """--draft-layers N|auto -> N or "auto"."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return int(str(text).strip())
    except ValueError:
        raise ConfigError(f"--draft-layers {text!r} is not a number of decoder layers or 'auto'") from None


def parse_draft_vocab(text: str | None) -> int | str | None:
    """--draft-vocab N|auto -> N, "auto" or None (not given)."""
    if text is None:
        return None
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return int(str(text).strip())
    except ValueError:
        raise ConfigError(f"--draft-vocab {text!r} is not a number of tokens or 'auto'") from None


def check_draft_vocab(value: int | str | None, vocab_size: int | None = None) -> None:
    """None, "auto", or a token count in [1, vocab_size] (the draft's vocabulary, once it is known)."""
    if value is None or value == "auto":
        return
    if isinstance(value, str):
        raise ConfigError(f"--draft-vocab {value!r} is not a number of tokens or 'auto'")
    check_number("--draft-vocab", value, low=1, high=vocab_size or 10**7)


def check_device(device: str) -> None:
    """Raise ConfigError when `device` names CUDA but torch sees no CUDA device (or not that many)."""
    if not device.startswith("cuda"):
        return
    import torch                                     # only here: the rest of this module is torch-free

    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device} but torch sees no CUDA device; use --device cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device} but torch sees only {torch.cuda.device_count()} CUDA device(s)")


def check_budget_fits(flag: str, value: int | None, total: int, what: str) -> None:
    """A --ram-budget/--gpu-budget beyond what the machine has (`total` bytes of `what`) is a typo, not a plan:
    planning with it would run out of memory halfway. Raise ConfigError naming both sizes (None: not given)."""
    if value is not None and value > total:
        raise ConfigError(f"{flag} {value / 1e9:.2f} GB is more than this machine's {total / 1e9:.2f} GB of {what}; "
                          f"pass at most that, or leave {flag} out to use what is free")


def check_draft_choice(draft: str | None, no_draft: bool, builder: str, builder_needs_draft: bool) -> None:
    """--draft PATH and --no-draft exclude each other; a builder that needs a draft needs one of them."""
    if draft and no_draft:
        raise ConfigError("--draft and --no-draft exclude each other; pass one of them")
    if not draft and not no_draft and builder_needs_draft:
        raise ConfigError(f"the {builder!r} builder needs a draft model: pass --draft PATH, "
                          "or --no-draft to decode with the target alone")


def check_prompt_length(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """Raise ConfigError unless the prompt is not empty and, plus max_new_tokens, fits the model's context."""
    if prompt_tokens == 0:
        raise ConfigError("the prompt is empty (0 tokens); pass some text")
    if prompt_tokens + max_new_tokens > context:
        raise ConfigError(f"the prompt has {prompt_tokens} tokens; with max_new_tokens {max_new_tokens} that "
                          f"exceeds the model's context of {context} tokens (at most "
                          f"{max(context - max_new_tokens, 0)} prompt tokens); shorten the prompt or lower "
                          "--max-new-tokens")


def check_prompt_text(text: str, what: str = "the prompt", allow_empty: bool = False) -> None:
    """Raise ConfigError for prompt text that is empty or whitespace only (unless allow_empty; generating from
    BOS alone is never what was meant) or not valid Unicode (lone surrogates: how Python hands over argv bytes
    that are not UTF-8). Control characters are fine: they are text the model sees."""
    if not allow_empty and not text.strip():
        raise ConfigError(f"{what} is empty; pass some text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} is not valid UTF-8 (undecodable byte at character {e.start}); "
                          "pass UTF-8 text") from None


def check_chat_options(chat: bool, system: str | None) -> None:
    """A system message only exists inside a chat template."""
    if system is not None and not chat:
        raise ConfigError("--system applies only with --chat; add --chat or drop --system")


def parse_budget_list(text: str, auto_supported: bool) -> tuple[int | str, ...]:
    """'16,64,256' -> (16, 64, 256); 'auto' is kept as 'auto' when this build can pick budgets itself."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ConfigError(f"--budgets {text!r} lists no budget; write them like 16,64,256")
    out: list[int | str] = []
    for item in items:
        if item.lower() == "auto":
            if not auto_supported:
                raise ConfigError("--budgets: 'auto' needs the budget tuner, which this build does not have; "
                                  "list integer budgets such as 16,64,256")
            out.append("auto")
            continue
        try:
            value = int(item)
        except ValueError:
            raise ConfigError(f"--budgets: {item!r} is not an integer or 'auto'; write them like 16,64,256") from None
        check_number("budget", value, low=1, high=MAX_BUDGET)
        out.append(value)
    return tuple(dict.fromkeys(out))


def parse_float_list(flag: str, text: str) -> tuple[float, ...]:
    """'0,0.6' -> (0.0, 0.6) for a list-valued flag such as --temperatures (each value is checked by whoever
    uses it, e.g. SamplingParams)."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ConfigError(f"{flag} {text!r} lists no value; write them like 0,0.6")
    try:
        values = [float(t) for t in items]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: every item must be a number, like 0,0.6") from None
    return tuple(dict.fromkeys(values))


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
