"""Frozen configuration built once at the edge: the model's shape, how tokens are sampled, how the engine and
the offloaded target run.

ModelArgs comes from a checkpoint's config.json; SamplingParams, EngineConfig and OffloadConfig from CLI flags
(or a server request, or models.yaml). Each validates itself on construction with the checks of
specexec/options.py, so a config that exists is a valid one and callers never re-validate.

Does not know: how a value was typed (options.py parses text), how weights are loaded or anything about trees.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from specexec.layer_shapes import (  # noqa: F401  (re-exported: the configs' one import)
    EXPERT_ACTIVATIONS, LAYER_TYPES, LINEAR_LAYOUTS, MLP_ACTS, ROUTERS, LatentArgs, LayerKind, LinearArgs, MoEArgs)
from specexec.options import (
    DTYPES, MAX_BUDGET, RELAXED_DELTA, RELAXED_K, ConfigError, check_accept, check_choice, check_draft_vocab, check_integer, check_name, check_number, choices,
    check_experts, choice_error, parse_draft_layers, parse_size)


@dataclass(frozen=True)
class ModelArgs:
    """Shape and named maths options of one decoder. specexec/families/ builds it from config.json (one module
    per family); the network reads the options, never the family name (`family` is for people and for
    models.yaml). `moe` is None for a dense model."""

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
    qk_norm_per_head: bool = True         # q/k RMSNorm over each head (Qwen3) or the whole projection (OLMoE)
    clip_qkv: float | None = None         # q, k, v clamped to +-clip_qkv after the projections (and q/k norms)
    attention_sinks: bool = False         # one learned logit per head in every softmax's denominator (gpt-oss)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEArgs | None = None
    # per-layer mixer kinds: layer_types[i] names one (HF's names; network/mixers.py runs them; the families read
    # LAYER_TYPES from config.json); () = every layer alike,
    # sliding when sliding_window is set (Mistral). A sliding layer sees the last `sliding_window` positions.
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None      # RoPE base of the sliding layers when they have their own (Gemma 3)
    local_rope_scaling: tuple[tuple[str, Any], ...] | None = None   # ... and its scaling (read only with a base)
    # Gemma 2/3
    embed_scale: bool = False            # embeddings x sqrt(dim), the scale cast to the run dtype first
    norm_plus_one: bool = False          # every RMSNorm scales by (1 + weight), in fp32 before the cast back
    sandwich_norms: bool = False         # norms after attention and around the MLP (pre/post_feedforward_layernorm)
    attn_scale: float | None = None      # attention score scale (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar)
    attn_softcap: float | None = None    # attention scores -> cap * tanh(scores / cap) before the softmax
    logit_softcap: float | None = None   # the LM head's logits likewise
    mlp_act: str = "silu"                # the MLP gate's activation: one of MLP_ACTS
    # Phi-3/4
    fused_qkv: bool = False              # one qkv_proj [q; k; v] instead of q/k/v_proj
    fused_gate_up: bool = False          # one gate_up_proj [gate; up] instead of gate/up_proj
    rope_dim: int | None = None          # rotary dimensions per head (partial rotary; None: all of head_dim)
    # GLM-4.5+, DeepSeek-V3: next-token-prediction layers stored after the last decoder layer (layers
    # n_layers .. n_layers + mtp_layers - 1 in the checkpoint); the target never runs them and leaves them unread
    mtp_layers: int = 0
    # Qwen3-Next / Qwen3.5
    attn_output_gate: bool = False       # q_proj also yields a per-head gate: attention out x sigmoid(gate)
    linear: LinearArgs | None = None     # the linear_attention layers' shape (layer_types names them)
    # other token-mixer kinds' own shapes, (kind name, its args: a frozen value) each (network/mixers.py)
    mixer_args: tuple[tuple[str, Any], ...] = ()
    # DeepSeek-V3, Kimi-K2: latent attention in its "latent_attention" layers (None: no such layer)
    latent: LatentArgs | None = None
    # Gemma 4: full-attention layers with their own head size and KV heads, values from the key projection
    global_head_dim: int | None = None   # head size of the full_attention layers (None: head_dim)
    global_kv_heads: int | None = None   # their KV heads (None: n_kv_heads)
    global_k_eq_v: bool = False          # their values are their keys' projection (no v_proj)
    v_norm: bool = False                 # values RMS-normalised per head, without a weight
    kv_shared_layers: int = 0            # the last N layers attend to the K/V of the last earlier layer of their
                                         # kind (computing none of their own)
    wide_shared_mlp: bool = False        # those layers' MLP is twice intermediate_size
    ple_dim: int = 0                     # per-layer input embeddings: each layer adds a gated [ple_dim] input
    ple_vocab: int = 0                   # ... looked up in a [ple_vocab, n_layers * ple_dim] table
    layer_scalar: bool = False           # each layer's output times a learned scalar

    def __post_init__(self) -> None:
        for name, high in (("n_layers", 4096), ("dim", 1 << 18), ("n_heads", 4096), ("head_dim", 4096),
                           ("intermediate_size", 1 << 20), ("vocab_size", 1 << 24),
                           ("max_position_embeddings", 1 << 25)):
            check_integer(name, getattr(self, name), low=1, high=high)
        check_integer("n_kv_heads", self.n_kv_heads, low=1, high=self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"{self.n_heads} attention heads do not share {self.n_kv_heads} KV heads evenly")
        check_number("norm_eps", self.norm_eps, low=0.0, high=1.0, low_open=True)
        check_number("rope_theta", self.rope_theta, low=0.0, high=1e15, low_open=True)
        check_choice("mlp activation", self.mlp_act, MLP_ACTS)
        if self.rope_dim is not None and not (0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0):
            raise ConfigError(f"rotary dimensions {self.rope_dim} must be even and in (0, head_dim {self.head_dim}]")
        for name in ("attn_softcap", "logit_softcap", "attn_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if self.layer_types:
            if len(self.layer_types) != self.n_layers:
                raise ConfigError(f"layer_types lists {len(self.layer_types)} layers, the model has {self.n_layers}")
            for kind in self.layer_types:        # which kinds run: network/mixers.py's registry says
                check_name("layer type", kind)
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")
            if "linear_attention" in self.layer_types and self.linear is None:
                raise ConfigError("layer_types has linear_attention layers but their shape (linear) is not set")
        if ("latent_attention" in self.layer_types) != (self.latent is not None):
            raise ConfigError("latent_attention layers and latent attention's shape (LatentArgs) go together")
        if self.kv_shared_layers:
            first = self.n_layers - self.kv_shared_layers
            check_integer("kv_shared_layers", self.kv_shared_layers, low=0, high=self.n_layers - 1)
            missing = {self.layer_kind(i) for i in range(first, self.n_layers)} - \
                {self.layer_kind(i) for i in range(first)}
            if missing:
                raise ConfigError(f"kv_shared_layers {self.kv_shared_layers}: a shared layer's kind has no earlier "
                                  "layer to share K/V with")
        if self.global_head_dim is not None and self.local_rope_theta is None and self.sliding_window:
            raise ConfigError("full layers with their own head size need the sliding layers' own RoPE")
        if self.latent is not None:
            m = self.latent
            if (self.n_kv_heads, self.head_dim, self.rope_dim) != (1, m.kv_rank + m.rope_dim, m.rope_dim):
                raise ConfigError(f"a latent attention model caches one row of kv_lora_rank + qk_rope_head_dim = "
                                  f"{m.kv_rank + m.rope_dim} values (n_kv_heads 1, head_dim {m.kv_rank + m.rope_dim}, "
                                  f"rope_dim {m.rope_dim}); got {self.n_kv_heads}, {self.head_dim}, {self.rope_dim}")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def mixer_args_of(self, kind: str) -> Any:
        """The shape a token-mixer kind keeps in mixer_args under its name (None: none given)."""
        return next((value for name, value in self.mixer_args if name == kind), None)

    def layer_kind(self, layer: int) -> LayerKind:
        """The attention kind of decoder layer `layer` (see LayerKind)."""
        sliding = self.layer_types[layer] == "sliding_attention" if self.layer_types else bool(self.sliding_window)
        if not sliding:
            return LayerKind()
        return LayerKind(self.sliding_window, "local" if self.local_rope_theta is not None else "global")

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Every decoder layer's kind, in order."""
        return tuple(self.layer_kind(i) for i in range(self.n_layers))

    def rope_params(self, rope: str) -> tuple[float, dict[str, Any] | None]:
        """(base, scaling dict or None) of one RoPE of LayerKind.rope ("global" | "local")."""
        if rope == "local" and self.local_rope_theta is not None:
            return self.local_rope_theta, dict(self.local_rope_scaling) if self.local_rope_scaling else None
        return self.rope_theta, self.rope_scaling_dict

    def attn_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head size) of decoder layer `layer`'s attention (Gemma 4's full layers: their own)."""
        if self.global_head_dim is not None and self.layer_kind(layer).window is None:
            return self.global_kv_heads or self.n_kv_heads, self.global_head_dim
        return self.n_kv_heads, self.head_dim

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V decoder layer `layer` attends to: itself, or for the last kv_shared_layers layers
        the last layer of its kind before them."""
        first = self.n_layers - self.kv_shared_layers
        if layer < first:
            return layer
        kind = self.layer_kind(layer)
        return max(i for i in range(first) if self.layer_kind(i) == kind)

    def rope_head_dim(self, rope: str) -> int:
        """The head size a RoPE table rotates ("global"/"long": the full layers', "local": the sliding ones')."""
        return self.global_head_dim if rope != "local" and self.global_head_dim is not None else self.head_dim

    def subset(self, layers: Sequence[int]) -> ModelArgs:
        """These args for a network that runs only decoder layers `layers` of this one, in that order (the
        self-draft): each keeps its kind (layer_types) and, for a mixture of experts, whether it is dense."""
        if self.kv_shared_layers or self.ple_dim:
            raise ConfigError("a subset of this model's layers cannot run alone: its layers share K/V or read "
                              "per-layer inputs by their index (--draft self is not supported for it)")
        ids = list(layers)
        kinds = tuple(self.layer_types[i] for i in ids) if self.layer_types else ()
        moe = self.moe
        if moe is not None and moe.dense_layers:
            moe = replace(moe, dense_layers=tuple(j for j, i in enumerate(ids) if i in moe.dense_layers))
        return replace(self, n_layers=len(ids), layer_types=kinds, moe=moe)


@dataclass(frozen=True)
class SamplingParams:
    """How one token is chosen from the (processed) logits. temperature 0 means greedy.

    repetition_penalty (HF) reads the whole context; presence_penalty and frequency_penalty (OpenAI, in
    [-2, 2]) read only the tokens generated by this request. logit_bias ((token id, bias in [-100, 100])
    pairs, OpenAI's) is added to the raw logits of draft and target alike. specexec.sampling.process_logits
    applies them."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

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
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise ConfigError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
            check_integer("logit_bias token id", pair[0], low=0, high=2**31 - 1)
            check_number(f"logit_bias[{pair[0]}]", pair[1], low=-100.0, high=100.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """Whether processing the logits reads the tokens before them (a history-dependent penalty is set)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class Acceptance:
    """How drafted tokens are judged (--accept). "exact": the acceptance rules keep the target's output (greedy
    equal to the target alone, sampling its distribution). "relaxed": LOSSY, opt-in, labelled wherever it shows: a
    drafted token also passes when the target's mass on its `k` nearest tokens (input-embedding cosine), moved onto
    it, keeps the total variation from the target's distribution at each node <= `delta` (specexec/acceptance/relaxed.py,
    docs/algorithms.md §32). delta and k mean nothing in exact mode."""

    mode: str = "exact"
    delta: float = RELAXED_DELTA
    k: int = RELAXED_K

    def __post_init__(self) -> None:
        check_accept(self.mode, self.delta, self.k)

    @property
    def relaxed(self) -> bool:
        return self.mode == "relaxed"

    @property
    def label(self) -> str:
        """'exact' or 'relaxed:delta=D,k=K', the text parse() reads back."""
        return "exact" if not self.relaxed else f"relaxed:delta={self.delta:g},k={self.k}"


EXACT = Acceptance()


PREFILL_CHUNK = 512      # prompt tokens per prefill pass of a resident model (EngineConfig.prefill_chunk overrides)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs: tree budget and builder, device and dtype. Validated on construction, except the
    builder and verifier names: their registries import this module (and torch, and every builder), so they
    are checked where they are used (builders.registry.make_builder, the Engine, Runtime.load)."""

    budget: int = 64                # the tree budget, or with auto_budget the largest budget tried
    auto_budget: bool = False       # --budget auto: specexec.tuning.budget picks each step's budget
    builder: str = "specexec"
    device: str = "cpu"
    dtype: str = "auto"
    max_new_tokens: int = 128
    prefill_chunk: int | None = None   # prompt tokens per prefill pass; None: PREFILL_CHUNK, or a streamed plan's
    verifier: str = "auto"
    builder_options: tuple[tuple[str, Any], ...] = field(default=())
    draft_vocab: int | str | None = None   # VocabTrim: the draft head keeps N target-frequent tokens, or "auto"
    kv_quant: str = "none"          # --kv-quant: "int8" stores KV rows quantized (LOSSY; never in an exactness claim)
    expert_trim: str = "experts"    # --expert-trim: a streamed MoE target verifies the nodes worth their experts
    gate: str = "auto"              # --gate: drafting stops while the target alone is faster (auto: with auto_budget)
    accept: Acceptance = EXACT      # --accept: exact, or relaxed (LOSSY, labelled: specexec/acceptance/relaxed.py)

    def __post_init__(self) -> None:
        check_number("budget", self.budget, low=1, high=MAX_BUDGET)
        check_choice("--kv-quant", self.kv_quant, choices("--kv-quant"))
        check_choice("--expert-trim", self.expert_trim, choices("--expert-trim"))
        check_choice("--gate", self.gate, choices("--gate"))
        if not isinstance(self.accept, Acceptance):
            raise ConfigError(f"accept must be an Acceptance (acceptance/parsing.parse('relaxed:delta=0.1')), got {self.accept!r}")
        check_draft_vocab(self.draft_vocab)
        check_number("max_new_tokens", self.max_new_tokens, low=1, high=10**7)
        if self.prefill_chunk is not None:
            check_integer("prefill_chunk", self.prefill_chunk, low=1, high=10**6)
        check_name("builder", self.builder)
        check_name("verifier", self.verifier)
        check_choice("dtype", self.dtype, DTYPES)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise choice_error("device", self.device, ("cpu", "cuda", "cuda:N"))

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
    the most the budget holds; specexec/runtime/self_draft.py).
    experts: --experts, where the routed experts of streamed MoE layers compute (options.EXPERT_MODES: stream,
    cpu, cpu:N, auto)."""

    quant: str = "auto"
    draft_quant: str = "none"
    offload: str = "auto"
    gpu_budget: int | None = None
    ram_budget: int | None = None
    cache_dir: str | None = None
    context: int | None = None
    kv_offload: str = "auto"
    draft_layers: int | str | None = None        # --draft self: decoder layers the draft runs (None/auto: planned)
    experts: str = "stream"     # --experts stream | cpu[:N] | auto: where a streamed MoE layer's experts compute

    def __post_init__(self) -> None:
        check_choice("--kv-offload", self.kv_offload, choices("--kv-offload"))
        check_experts(self.experts)
        if self.context is not None:
            check_integer("--context", self.context, low=16, high=10**7)
        if self.draft_layers is not None and self.draft_layers != "auto":
            check_integer("--draft-layers", self.draft_layers, low=1, high=10**5)
        for flag, value in (("--quant", self.quant), ("--draft-quant", self.draft_quant),
                            ("--offload", self.offload)):
            check_choice(flag, value, choices(flag))
        for flag, value in (("--gpu-budget", self.gpu_budget), ("--ram-budget", self.ram_budget)):
            if value is not None:
                check_number(flag, value, low=1, high=2**62)
        if self.cache_dir is not None and not str(self.cache_dir).strip():
            raise ConfigError("--cache-dir is empty; pass a directory or leave it out")

    @classmethod
    def from_flags(cls, quant: str | None = None, draft_quant: str | None = None, offload: str | None = None,
                   gpu_budget: str | None = None, ram_budget: str | None = None,
                   cache_dir: str | None = None, context: int | None = None,
                   kv_offload: str | None = None, draft_layers: str | None = None,
                   experts: str | None = None) -> "OffloadConfig":
        """From command-line strings (None = default); sizes like 20GB, 512MiB."""
        kw: dict[str, Any] = {k: v for k, v in (("quant", quant), ("draft_quant", draft_quant),
                                                 ("offload", offload), ("cache_dir", cache_dir),
                                                 ("context", context), ("kv_offload", kv_offload),
                                                 ("experts", experts)) if v is not None}
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
