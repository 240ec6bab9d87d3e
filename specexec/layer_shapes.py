"""The parts of a decoder layer's shape that ModelArgs (specexec/config.py) holds as their own frozen values: the
routed feed-forward (MoEArgs), linear attention (LinearArgs), latent attention (LatentArgs), and the
attention kind of a layer (LayerKind).
Each validates itself on construction with the checks of specexec/options.py.

Does not know: config.json (specexec/families/ reads it), the network that computes them.
"""
from __future__ import annotations

from dataclasses import dataclass

from specexec.options import ConfigError, check_choice, check_integer, check_number


ROUTERS = ("softmax", "topk_softmax", "sigmoid")
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu", "gelu_tanh")


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
    Gemma 4's block: the router reads its input RMS-normalised without a weight, times a learned [dim] `scale`
    and dim ** -0.5 (`router_input_norm`), and multiplies each kept weight by its expert's learned scale
    (`per_expert_scale`); with `parallel_dense` the layer's dense MLP runs beside the experts on the same
    input, each branch with its own norms, and the two outputs are added (specexec/network/moe.py).
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
    router_input_norm: bool = False      # Gemma 4: the router reads RMSNorm(x) * scale * dim ** -0.5
    per_expert_scale: bool = False       # Gemma 4: each kept weight times its expert's learned scale
    parallel_dense: bool = False         # Gemma 4: a dense MLP beside the experts (mlp.dense), outputs added

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
