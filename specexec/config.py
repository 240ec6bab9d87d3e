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

from specexec.options import (
    DTYPES, MAX_BUDGET, RELAXED_DELTA, RELAXED_K, ConfigError, check_accept, check_choice, check_draft_vocab, check_integer, check_name, check_number, choices,
    check_experts, choice_error, parse_accept, parse_draft_layers, parse_size)


ROUTERS = ("softmax", "topk_softmax", "sigmoid")
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class MoEArgs:
    """The sparse feed-forward of a mixture-of-experts decoder (None in ModelArgs for a dense one); the maths is
    specexec/network/moe.py.

    Each token's router (a [n_experts, dim] linear, with a bias when `router_bias`) scores every expert and
    keeps the `top_k` best; `router` says how scores become weights: "softmax" (softmax over all experts, then
    the top k; renormalised to sum to 1 when `norm_topk_prob`: Mixtral, Qwen3-MoE, OLMoE), "topk_softmax" (the
    top k logits, then a softmax over those k: gpt-oss), "sigmoid" (sigmoid of each logit, then the top k;
    renormalised when `norm_topk_prob`). The token's output is the weighted sum of its experts' outputs, times
    `routed_scale` (routed_scaling_factor). A sigmoid router may choose with biased scores: with `score_bias`
    (e_score_correction_bias, a learned [n_experts] vector) the top k are chosen by sigmoid + bias while the
    weights stay the unbiased sigmoids (GLM-4.5, MiniMax-M2, DeepSeek-V3). Group-limited routing (`n_group` > 1)
    splits the experts into n_group equal groups, scores each group by the sum of its two best (biased) scores,
    and lets a row choose only among the experts of its `topk_group` best groups. `router_fp32`: the router's
    logits are computed in fp32 whatever the run dtype (the families that keep the router in fp32).
    Each expert is a gated MLP of `expert_dim` (biases when `expert_bias`) whose activation is "silu"
    (silu(gate) * up) or "clamped_swiglu" (gpt-oss: gate clamped above at `swiglu_limit`, up clamped to
    +-swiglu_limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate)). `shared_dim` > 0 adds one shared expert of
    that width that every token runs (silu, no biases), scaled by sigmoid of a [1, dim] gate when
    `shared_gate` (Qwen2-MoE). Layers in `dense_layers` have a plain MLP of ModelArgs.intermediate_size instead."""

    n_experts: int
    top_k: int
    expert_dim: int                      # each expert's intermediate size (moe_intermediate_size)
    norm_topk_prob: bool = True
    router: str = "softmax"              # one of ROUTERS
    router_bias: bool = False            # the router linear carries a bias
    expert_bias: bool = False            # every expert's gate/up/down projections carry biases
    activation: str = "silu"             # one of EXPERT_ACTIVATIONS
    swiglu_alpha: float = 1.702          # clamped_swiglu only
    swiglu_limit: float = 7.0            # clamped_swiglu only
    shared_dim: int = 0                  # the shared expert's intermediate size (0: none)
    shared_gate: bool = False            # the shared expert's output is scaled by sigmoid(x @ gate.T)
    dense_layers: tuple[int, ...] = ()   # decoder layers whose feed-forward is a dense MLP
    score_bias: bool = False             # sigmoid router: choose by sigmoid + e_score_correction_bias
    n_group: int = 1                     # group-limited routing: the experts in n_group equal groups ...
    topk_group: int = 1                  # ... of which each row may use its topk_group best
    routed_scale: float = 1.0            # the routed experts' weighted sum times this (routed_scaling_factor)
    router_fp32: bool = False            # router logits in fp32 whatever the run dtype

    def __post_init__(self) -> None:
        check_integer("n_experts", self.n_experts, low=1, high=1 << 16)
        check_integer("n_group", self.n_group, low=1, high=self.n_experts)
        check_integer("topk_group", self.topk_group, low=1, high=self.n_group)
        if self.n_experts % self.n_group:
            raise ConfigError(f"{self.n_experts} experts do not split into n_group {self.n_group} equal groups")
        check_integer("top_k", self.top_k, low=1, high=self.n_experts // self.n_group * self.topk_group)
        if self.n_group > 1 and self.n_experts // self.n_group < 2:
            raise ConfigError(f"group-limited routing scores a group by its two best experts; n_group "
                              f"{self.n_group} leaves {self.n_experts // self.n_group} per group")
        if self.score_bias and self.router != "sigmoid":
            raise ConfigError(f"a routing score bias needs the sigmoid router, not {self.router!r}")
        check_number("routed_scale", self.routed_scale, low=0.0, high=1e6, low_open=True)
        check_integer("expert_dim", self.expert_dim, low=1, high=1 << 20)
        check_integer("shared_dim", self.shared_dim, low=0, high=1 << 20)
        check_choice("router", self.router, ROUTERS)
        check_choice("expert activation", self.activation, EXPERT_ACTIVATIONS)
        check_number("swiglu_limit", self.swiglu_limit, low=0.0, high=1e6, low_open=True)
        check_number("swiglu_alpha", self.swiglu_alpha, low=-1e6, high=1e6)

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the sparse (routed) feed-forward."""
        return layer not in self.dense_layers


LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention", "latent_attention")  # specexec runs
LINEAR_LAYOUTS = ("qkvz", "split")


@dataclass(frozen=True)
class LinearArgs:
    """The linear-attention (Gated DeltaNet) layers of a hybrid decoder (None in ModelArgs when it has none); the
    maths is specexec/network/linear_attention.py, its state per tree branch specexec/kv/recurrent.py.

    `k_heads` query/key heads of `k_dim` and `v_heads` value heads of `v_dim` (each key head serves
    v_heads // k_heads consecutive value heads); a causal depthwise convolution of `conv_kernel` taps over the
    concatenated q, k, v. `layout` says how the input projections are stored: "qkvz" (Qwen3-Next: in_proj_qkvz
    and in_proj_ba, grouped per key head) or "split" (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int = 4
    layout: str = "split"

    def __post_init__(self) -> None:
        for name in ("k_heads", "v_heads", "k_dim", "v_dim"):
            check_integer(name, getattr(self, name), low=1, high=1 << 16)
        check_integer("conv_kernel", self.conv_kernel, low=1, high=64)
        check_choice("linear-attention layout", self.layout, LINEAR_LAYOUTS)
        if self.v_heads % self.k_heads:
            raise ConfigError(f"{self.v_heads} value heads do not divide into {self.k_heads} key heads")

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q and k (k_heads x k_dim each) and v (v_heads x v_dim)."""
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


@dataclass(frozen=True)
class LatentArgs:
    """Multi-head latent attention (MLA: DeepSeek-V2/V3/R1, Kimi-K2; specexec/network/latent.py), the token mixer of
    "latent_attention" layers. Each token's keys and values of all heads come from one latent: c = RMSNorm(x
    W_kv_a)[:kv_rank] expanded per head by kv_b_proj into `nope_dim` key and `v_dim` value dimensions, plus one
    shared `rope_dim` key part that carries the position (RoPE, pairs interleaved when `interleaved`). The query
    is x W_q, or low-rank x W_q_a -> RMSNorm -> W_q_b when `q_rank` is set; its nope_dim part meets the keys'
    expanded part, its rope_dim part the shared rotary key. The cache holds the latent and the rotary key,
    kv_rank + rope_dim values per token and layer (ModelArgs.head_dim, one KV head, one row read as both key
    and value). `norm_eps`: the two low-rank RMSNorms' epsilon (transformers keeps them at 1e-6 whatever the
    model's norm_eps)."""

    kv_rank: int                 # kv_lora_rank
    rope_dim: int                # qk_rope_head_dim
    nope_dim: int                # qk_nope_head_dim
    v_dim: int                   # v_head_dim
    q_rank: int | None = None    # q_lora_rank (None: a full-rank q_proj)
    interleaved: bool = True     # rope_interleave: the rotary pairs are (0, 1), (2, 3), ... in the weights
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("kv_rank", "rope_dim", "nope_dim", "v_dim"):
            check_integer(name, getattr(self, name), low=1, high=1 << 16)
        if self.rope_dim % 2:
            raise ConfigError(f"qk_rope_head_dim {self.rope_dim} must be even")
        if self.q_rank is not None:
            check_integer("q_lora_rank", self.q_rank, low=1, high=1 << 16)
MLP_ACTS = ("silu", "gelu_tanh", "gelu")      # the MLP gate's activations (HF: silu, gelu_pytorch_tanh, gelu)


@dataclass(frozen=True)
class LayerKind:
    """How the decoder layers of one kind attend: `window` (sliding window in positions; None: the whole
    context) and `rope` ("global": ModelArgs.rope_theta / rope_scaling; "local": local_rope_theta /
    local_rope_scaling). Layers of one kind share one attention plan and one RoPE table per forward."""

    window: int | None = None
    rope: str = "global"


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
    # per-layer attention kinds: layer_types[i] is one of LAYER_TYPES (HF's names); () = every layer alike,
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
    # DeepSeek-V3, Kimi-K2: latent attention in its "latent_attention" layers (None: no such layer)
    latent: LatentArgs | None = None

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
            for kind in self.layer_types:
                check_choice("layer type", kind, LAYER_TYPES)
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")
            if "linear_attention" in self.layer_types and self.linear is None:
                raise ConfigError("layer_types has linear_attention layers but their shape (linear) is not set")
        if ("latent_attention" in self.layer_types) != (self.latent is not None):
            raise ConfigError("latent_attention layers and latent attention's shape (LatentArgs) go together")
        if self.latent is not None:
            m = self.latent
            if (self.n_kv_heads, self.head_dim, self.rope_dim) != (1, m.kv_rank + m.rope_dim, m.rope_dim):
                raise ConfigError(f"a latent attention model caches one row of kv_lora_rank + qk_rope_head_dim = "
                                  f"{m.kv_rank + m.rope_dim} values (n_kv_heads 1, head_dim {m.kv_rank + m.rope_dim}, "
                                  f"rope_dim {m.rope_dim}); got {self.n_kv_heads}, {self.head_dim}, {self.rope_dim}")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

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

    def subset(self, layers: Sequence[int]) -> ModelArgs:
        """These args for a network that runs only decoder layers `layers` of this one, in that order (the
        self-draft): each keeps its kind (layer_types) and, for a mixture of experts, whether it is dense."""
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
    it, keeps the total variation from the target's distribution at each node <= `delta` (specexec/relaxed.py,
    docs/algorithms.md §31). delta and k mean nothing in exact mode."""

    mode: str = "exact"
    delta: float = RELAXED_DELTA
    k: int = RELAXED_K

    def __post_init__(self) -> None:
        check_accept(self.mode, self.delta, self.k)

    @classmethod
    def parse(cls, text: str) -> "Acceptance":
        """From --accept's text: exact | relaxed[:delta=D,k=K] (options.parse_accept)."""
        return cls(*parse_accept(text))

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
    accept: Acceptance = EXACT      # --accept: exact, or relaxed (LOSSY, labelled: specexec/relaxed.py)

    def __post_init__(self) -> None:
        check_number("budget", self.budget, low=1, high=MAX_BUDGET)
        check_choice("--kv-quant", self.kv_quant, choices("--kv-quant"))
        check_choice("--expert-trim", self.expert_trim, choices("--expert-trim"))
        check_choice("--gate", self.gate, choices("--gate"))
        if not isinstance(self.accept, Acceptance):
            raise ConfigError(f"accept must be an Acceptance (Acceptance.parse('relaxed:delta=0.1')), got {self.accept!r}")
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
