"""One pre-norm decoder for every family specexec runs (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3/4, and the
mixtures of experts Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss, GLM-4.5+, MiniMax-M2), its differences named
options of ModelArgs (q/k norms, sandwich norms, soft-capping, fused projections, partial rotary, sinks, ...):
pure maths.

`forward(tokens, positions, mask, cache, slots)` serves prefill, one-token decode and tree verification alike:
positions are explicit (tree siblings share one), the mask says which cache slots each token sees (a `TreeMask`:
the whole committed prefix plus a small mask over the new tokens' own slots; or a dense bool mask), and `slots`
says where each token's K/V is written. Layers come in kinds (ModelArgs.layer_kind: a sliding window or none, the
global or a local RoPE): per forward the mask becomes one `AttentionPlan` per window and the positions one cos/sin
table per RoPE, and each layer attends with its kind's (specexec/network/attention.py: prefix and tree attended apart,
merged exactly; soft-capping inside each part, attention sinks at the merge). A layer's feed-forward is the dense
MLP or, where ModelArgs.moe says the layer is sparse, specexec/network/moe.py's router-then-experts block, whose routing
of each pass goes to its Execution's `routing` (a RoutingLog; None records nothing). Parameter names follow the Hub
checkpoints without the leading "model." (the MoE names are specexec/network/moe.py's; specexec/checkpoints/weight_map.py maps a
checkpoint's own names onto them). `logits(hidden, rows)` computes the LM head only for the rows a caller needs;
callers chunk it (2,048 nodes x 152k vocabulary in fp32 is 1.2 GB). The pieces a layer is made of live beside it:
specexec/network/mixers.py (the token mixer of each layer, by kind: specexec/network/self_attention.py, ...),
specexec/network/norms.py (RMSNorm), specexec/network/rope.py (RoPE), specexec/network/ffn.py (the gated MLP),
specexec/network/moe.py (the sparse feed-forward).

Does not know: checkpoints, devices, quantization formats (a quantized Linear is swapped in from outside),
offloading (OffloadedTransformer overrides `layer_modules`), trees or sampling.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from specexec.network.attention import AttentionPlan, TreeMask, build_plan, pick_kernel
from specexec.config import ModelArgs
from specexec.network.ffn import ACTIVATIONS, MLP
from specexec.kv.cache import KVCache
from specexec.network.linear_attention import tree_plan
from specexec.network.mixers import has_tree_plans, mixer_kind, new_cache
from specexec.network.moe import RoutingLog, SparseMLP
from specexec.network.norms import RMSNorm
from specexec.network.rope import attention_factor, long_switch, rope_inv_freq, rope_names

LOGIT_CHUNK = 256        # rows of the LM head callers compute at once: 256 x 152k fp32 = 155 MB
_INITS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_")


@contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device (nothing allocated) without running their weight init: every weight is
    loaded, bound or replaced right after. Needed for start-up time, not memory: torch initialises meta tensors
    through its Python reference kernels, whose first use imports torch._dynamo (seconds). nn.init is patched
    only inside the block, so modules built elsewhere at the same time (another thread) would skip their init
    too; callers build from one thread."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    try:
        for name in _INITS:
            setattr(nn.init, name, _leave)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _leave(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


class BlockPath(Protocol):
    """A layer's pass some other way (specexec/runtime/cpu_blocks.FastBlock: the layer as one compiled call):
    (x, cos, sin, plan, cache, layer, slots) -> [B, T, D], or None where it declines the pass."""

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
                 cache: KVCache | None, layer: int, slots: torch.Tensor | None) -> torch.Tensor | None: ...


class StackPath(Protocol):
    """The whole decoder stack's pass some other way (cpu_blocks.FastStack): (x, ropes, plans, cache, slots) ->
    [B, T, D] before the final norm, or None where it declines the pass."""

    def __call__(self, x: torch.Tensor, ropes: dict, plans: dict, cache: KVCache | None,
                 slots: torch.Tensor | None) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class Execution:
    """Every way a Transformer runs besides its torch modules, told by whoever assembles it (Transformer.run_as;
    a decoder layer is told through Block.run_as): the model never looks these up.

    row_exact: its linears are row-exact (the CPU integer kernels), so attention runs row by row too
        (attention.build_plan's row_exact) and each router scores one row at a time (moe.Router.row_exact): a
        tree pass gives every token its one-token bits (runtime/cpu_blocks.py, runtime/offloaded.py).
    stack: the whole decoder stack in one call where it serves a pass (a StackPath: cpu_blocks.fast_stack).
    routing: where each sparse layer's routing goes between its router and its experts (a RoutingLog; an
        ExpertStream also fetches the routed experts: runtime/expert_stream.py); None records nothing.
    taps: decoder layers whose input each pass keeps in the model's `tapped` (tap n_layers: the last layer's
        output before the norm), for a drafter that reads them (network/drafter.py); the stack path steps aside."""

    row_exact: bool = False
    stack: StackPath | None = None
    routing: RoutingLog | None = None
    taps: tuple[int, ...] = ()


class Block(nn.Module):
    """One decoder layer: a pre-norm token mixer and a feed-forward with residuals; with sandwich_norms (Gemma)
    the mixer's and the feed-forward's outputs are normalised too (post_attention_layernorm then normalises the
    mixer output, pre_feedforward_layernorm the MLP input: the checkpoints' own names). The mixer is the layer's
    kind's (specexec/network/mixers.py: attention as `self_attn`, ...), `mixer` names it whatever its attribute.
    The feed-forward of decoder layer `layer` is a SparseMLP (specexec/network/moe.py) when ModelArgs.moe says
    that layer is sparse, else the dense MLP. `run_as` tells it another path for its passes (`fast`) and
    whether its model is row-exact."""

    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        self.fast: BlockPath | None = None
        norm = lambda: RMSNorm(args.dim, args.norm_eps, args.norm_plus_one)     # noqa: E731
        kind = mixer_kind(args, layer)
        mixer = kind.build(args, layer)                 # None: a layer of this kind has no token mixer
        self.mixer_attribute = kind.attribute if mixer is not None else None
        if mixer is not None:
            self.input_layernorm = norm()
            setattr(self, kind.attribute, mixer)
        sparse = args.moe is not None and args.moe.sparse(layer)
        self.parallel = kind.ffn and sparse and args.moe.parallel_dense    # the sparse block normalises its input
        self.mlp: nn.Module | None = None               # a kind without a feed-forward (MixerKind.ffn) has none
        if kind.ffn:
            self.post_attention_layernorm = norm()
            if args.sandwich_norms:
                if not self.parallel:
                    self.pre_feedforward_layernorm = norm()
                self.post_feedforward_layernorm = norm()
            self.mlp = SparseMLP(args, layer) if sparse else MLP(args, layer)
        if args.ple_dim:                            # Gemma 4: this layer's per-layer input, gated by its output
            self.per_layer_input_gate = nn.Linear(args.dim, args.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(args.ple_dim, args.dim, bias=False)
            self.post_per_layer_input_norm = norm()
            self.act = ACTIVATIONS[args.mlp_act]
        if args.layer_scalar:
            self.layer_scalar = nn.Parameter(torch.ones(1))

    def run_as(self, fast: BlockPath | None, row_exact: bool) -> None:
        """This layer's passes run `fast` where it serves them (None: the modules); row_exact: its model's
        linears are row-exact, so a sparse layer's router scores one row at a time (Execution.row_exact)."""
        self.fast = fast
        router = getattr(self.mlp, "router", None)
        if router is not None:
            router.row_exact = row_exact

    @property
    def mixer(self) -> nn.Module | None:
        """The layer's token mixer (its kind's attribute; None: its kind has none)."""
        return self._modules[self.mixer_attribute] if self.mixer_attribute is not None else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
                cache: KVCache | None, layer: int, slots: torch.Tensor | None,
                routing: RoutingLog | None = None, layer_input: torch.Tensor | None = None) -> torch.Tensor:
        """A sparse layer routes first, hands the routing to `routing` (when given), then runs the experts. A
        layer given a `fast` path (x, cos, sin, plan, cache, layer, slots) -> [B, T, D] or None (declined) runs
        that where it serves the pass (specexec/runtime/cpu_blocks.py: the layer as one compiled call).
        layer_input [B, T, ple_dim]: this layer's per-layer input (ModelArgs.ple_dim; Transformer.layer_inputs)."""
        if self.fast is not None:
            y = self.fast(x, cos, sin, plan, cache, layer, slots)
            if y is not None:
                return y
        mixer = self.mixer
        h = mixer(self.input_layernorm(x), cos, sin, plan, cache, layer, slots) if mixer is not None else None
        return self.after_mixer(x, h, layer, routing, layer_input)

    def after_mixer(self, x: torch.Tensor, h: torch.Tensor, layer: int, routing: RoutingLog | None = None,
                    layer_input: torch.Tensor | None = None) -> torch.Tensor:
        """The layer past its token mixer, row by row: x [B, T, D] the layer's input, h [B, T, D] the mixer's
        output (None: the layer has no mixer) -> the layer's output [B, T, D] (residuals, norms, the feed-forward
        when it has one, the per-layer input). A forest pass (specexec/batching/) runs it once over every request's
        rows."""
        if self.mlp is None:                                 # a kind without a feed-forward: the mixer's residual
            return self._finish(x + h, layer_input)
        sandwich = hasattr(self, "post_feedforward_layernorm")
        if sandwich:
            x = x + self.post_attention_layernorm(h) if h is not None else x
            h = x if self.parallel else self.pre_feedforward_layernorm(x)
        else:
            x = x + h if h is not None else x
            h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, SparseMLP):
            route = self.mlp.route(h)
            if routing is not None:
                routing.record(layer, route)
            out = self.mlp.combine(h, route) if routing is None else routing.combine(layer, self.mlp, h, route)
        else:
            out = self.mlp(h)
        x = x + (self.post_feedforward_layernorm(out) if sandwich else out)
        return self._finish(x, layer_input)

    def _finish(self, x: torch.Tensor, layer_input: torch.Tensor | None) -> torch.Tensor:
        """The per-layer input (Gemma 4) and the layer's scalar, where it has them."""
        if layer_input is not None:
            gate = self.act(self.per_layer_input_gate(x)) * layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return x * self.layer_scalar if hasattr(self, "layer_scalar") else x


class Transformer(nn.Module):
    """Embedding, decoder blocks, final norm and LM head. See the module docstring for the call contract; how it
    runs besides its modules is its `execution` (Execution), told through `run_as`."""

    finite_probe: list | None = None  # when a list: each layer's input, then the stack's output, adds its count of
    #                                  non-finite values to it as a device scalar (no host sync; the engine reads it)
    tapped: list[torch.Tensor] | None = None       # the last pass's tapped layer inputs (Execution.taps)

    def __init__(self, args: ModelArgs, execution: Execution = Execution()) -> None:
        super().__init__()
        self.args = args
        self.execution = execution
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_plus_one)
        if args.ple_dim:                            # Gemma 4's per-layer input embeddings (layer_inputs)
            width = args.n_layers * args.ple_dim
            self.embed_tokens_per_layer = nn.Embedding(args.ple_vocab, width)
            self.per_layer_model_projection = nn.Linear(args.dim, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(args.ple_dim, args.norm_eps, args.norm_plus_one)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        for rope in rope_names(args):              # inv_freq (global), inv_freq_local (Gemma 3's sliding layers)
            self.register_buffer(_rope_buffer(rope), rope_inv_freq(args, rope), persistent=False)

    def run_as(self, execution: Execution) -> None:
        """Run as `execution` says from the next forward on (Execution: row-exactness, a whole-stack path, where
        routing goes). The layers are told their own part through Block.run_as."""
        self.execution = execution

    def drop_tapped(self) -> None:
        """Let go of the last pass's tapped layer inputs (the caller has read what it needs)."""
        self.tapped = None

    @property
    def routing(self) -> RoutingLog | None:
        """Where each sparse layer's routing goes (Execution.routing)."""
        return self.execution.routing

    @property
    def head_weight(self) -> torch.Tensor:
        """[V, D] LM head weight (the embedding when tied and no head module was swapped in; a quantized head's
        dequantized weight, a new tensor)."""
        head = self._modules.get("lm_head")
        if head is None:
            return self.embed_tokens.weight
        return head.weight if isinstance(head, nn.Linear) else head.dequantize()

    def layer_modules(self) -> Iterator[tuple[int, Block]]:
        """(index, block) in order; the offloaded model streams them instead."""
        return enumerate(self.layers)

    def init_rope(self, device: torch.device | str, like: Transformer | None = None) -> None:
        """Set the RoPE tables on `device` (a model built on meta has none): computed, or `like`'s own."""
        for rope in rope_names(self.args):
            name = _rope_buffer(rope)
            setattr(self, name, getattr(like, name) if like is not None else
                    rope_inv_freq(self.args, rope).to(device))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, rope: str = "global"
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, rope_dim] of one RoPE table (rope_names) for `apply_rope`,
        computed in fp32 then cast: (cos f, cos f) and (-sin f, sin f) for f = position x inv_freq, both times
        the table's attention factor (YaRN's or LongRoPE's; 1 otherwise)."""
        freqs = positions.float().unsqueeze(-1) * getattr(self, _rope_buffer(rope)).to(positions.device)
        cos, sin = torch.cat((freqs, freqs), -1).cos(), freqs.sin()
        sin = torch.cat((-sin, sin), -1)
        factor = attention_factor(self.args, rope)
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)

    def long_rope(self, positions: torch.Tensor, cache: KVCache | None) -> bool:
        """Whether this forward uses LongRoPE's long factors: as the cache's rows were computed (the engine
        sets `cache.long_rope` from the sequence's length), or without a cache when the positions run past the
        original context (transformers' rule; reads the positions on the host)."""
        switch = long_switch(self.args)
        if switch is None:
            return False
        return cache.long_rope if cache is not None else int(positions.max()) + 1 > switch

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: TreeMask | torch.Tensor | None = None,
                cache: KVCache | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions [B, T]; mask: a TreeMask (prefix = committed cache slots every token sees, tree
        bool [T, K] over the slots that follow), or a dense bool [B, 1, T, S] over cache slots [0, S), or None
        (causal, no cache); slots [T]: where each token's K/V goes (default cache.length + arange(T)). Returns
        hidden [B, T, D] after the final norm. Cache length is NOT advanced here: commit with cache.keep()."""
        if cache is not None:
            if mask is None:
                raise ValueError("a cached forward needs an explicit mask over the cache slots")
        elif isinstance(mask, TreeMask) and mask.prefix:
            raise ValueError(f"a TreeMask with a prefix of {mask.prefix} slots needs the cache holding them")
        x = self.embed(tokens)
        if not self.args.ple_dim:
            return self.decode(x, positions, mask, cache, slots)
        return self.decode(x, positions, mask, cache, slots, self.layer_inputs(tokens, x))

    def layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """tokens [B, T], their embedded rows x [B, T, D] -> every layer's per-layer input [B, T, n_layers,
        ple_dim] (Gemma 4): the token's row of embed_tokens_per_layer times sqrt(ple_dim), and the normed
        projection of x times dim ** -0.5, added and times 2 ** -0.5."""
        a = self.args
        B, T = tokens.shape
        own = self.embed_tokens_per_layer(tokens)
        own = own * torch.tensor(a.ple_dim ** 0.5, dtype=torch.float32).to(own.dtype)
        seen = self.per_layer_model_projection(x) * a.dim ** -0.5
        seen = self.per_layer_projection_norm(seen.reshape(B, T, a.n_layers, a.ple_dim))
        return (seen + own.reshape(B, T, a.n_layers, a.ple_dim)) * 2.0 ** -0.5

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> embedded rows [B, T, D] on the model's device (forward's first step); with embed_scale
        (Gemma) times sqrt(dim), that scale rounded to the run dtype first (transformers' Gemma: a float32
        sqrt(dim) cast to the weight's dtype)."""
        x = self.embed_tokens(tokens)
        if self.args.embed_scale:
            x = x * torch.tensor(self.args.dim ** 0.5, dtype=torch.float32).to(x.dtype)
        return x

    def decode(self, x: torch.Tensor, positions: torch.Tensor, mask: TreeMask | torch.Tensor | None,
               cache: KVCache | None, slots: torch.Tensor | None,
               layer_inputs: torch.Tensor | None = None) -> torch.Tensor:
        """forward after the embedding: x [B, T, D] through every decoder layer and the final norm -> hidden
        [B, T, D] (layer_inputs [B, T, n_layers, ple_dim]: the per-layer inputs, ModelArgs.ple_dim). forward
        checks the arguments; a CUDA graph of the draft captures this part alone (builders/draft_graphs.py: an
        embedding may live on the host). With Execution.taps the input of each tapped layer (tap n_layers: the last
        layer's output, before the norm) is kept in `tapped`, in layer order (each [B, T, D]), and the
        whole-stack fast path steps aside. Without a cache, layers that attend to an earlier layer's K/V read a
        scratch cache of this forward's rows."""
        tree = tree_plan(mask, positions, slots) if has_tree_plans(self.args) else None   # before: slots None
        if cache is None and self.args.kv_shared_layers:
            T = x.shape[1]
            cache, slots = self.new_cache(T), torch.arange(T, device=x.device)
        if cache is not None:
            cache.begin_forward()
            if slots is None:
                slots = torch.arange(cache.length, cache.length + x.shape[1], device=x.device)
        kinds = self.args.layer_kinds
        long = self.long_rope(positions, cache)
        ropes = {rope: self.rope(positions, x.dtype, "long" if long and rope == "global" else rope)
                 for rope in {k.rope for k in kinds}}
        plans = self.attention_plans(mask, positions, x.dtype)
        run = self.execution
        if run.routing is not None:
            run.routing.begin()
        probe = self.finite_probe
        if run.stack is not None and not run.taps and probe is None:
            y = run.stack(x, ropes, plans, cache, slots)
            if y is not None:
                return self.norm(y)
        taps, tapped = run.taps, []
        for i, layer in self.layer_modules():
            if i in taps:
                tapped.append(x)
            if probe is not None:
                probe.append(x.isfinite().logical_not().sum())
            kind = kinds[i]
            plan = tree if mixer_kind(self.args, i).plan == "tree" else plans[kind.window]
            own = layer_inputs[:, :, i] if layer_inputs is not None else None
            x = layer(x, *ropes[kind.rope], plan, cache, i, slots, run.routing, own)
        if taps:
            self.tapped = tapped + ([x] if self.args.n_layers in taps else [])
        if probe is not None:
            probe.append(x.isfinite().logical_not().sum())
        return self.norm(x)

    def new_cache(self, capacity: int, quant: str = "none", tail: int = 0) -> KVCache:
        """A KV cache for this model with `capacity` slots, rows in its dtype on its device (int8 when quant
        says so: lossy). tail: rows of one forward beyond the committed prefix (only streamed layers use it)."""
        p = next(self.parameters())
        return new_cache(self.args, capacity, p.dtype, p.device, quant)

    def attention_plans(self, mask: TreeMask | torch.Tensor | None, positions: torch.Tensor,
                        dtype: torch.dtype) -> dict[int | None, AttentionPlan]:
        """The mask in the form the layers attend with, built once per forward for each sliding window the
        layers have (None: full attention), never per layer (positions [B, T]). A dense mask is used as given
        (the caller applied any window), so it cannot serve layers whose windows differ."""
        a = self.args
        windows = sorted({k.window for k in a.layer_kinds}, key=lambda w: (w is not None, w or 0))
        if isinstance(mask, torch.Tensor) and len(windows) > 1:
            raise ValueError(f"layers with sliding windows {windows} need a TreeMask, not one dense mask")
        kv_heads = {k.window: a.attn_shape(i)[0] for i, k in enumerate(a.layer_kinds)}   # per window its layers'
        return {w: build_plan(mask, positions, positions.shape[-1], w, a.n_heads // kv_heads[w], dtype,
                              pick_kernel(positions.device), a.attn_scale, a.attn_softcap,
                              self.execution.row_exact) for w in windows}

    def attention_plan(self, mask: TreeMask | torch.Tensor | None, positions: torch.Tensor,
                       dtype: torch.dtype) -> AttentionPlan:
        """The plan decoder layer 0 attends with (attention_plans)."""
        return self.attention_plans(mask, positions, dtype)[self.args.layer_kind(0).window]

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., D] -> fp32 logits [R, V] for `rows` of the flattened hidden (all rows when None)."""
        h = hidden.reshape(-1, hidden.shape[-1])
        if rows is not None:
            h = h.index_select(0, rows)
        head = self._modules.get("lm_head")            # a tied model has none, unless a quantized one was set
        logits = (F.linear(h, self.embed_tokens.weight) if head is None else head(h)).float()
        return soft_cap(logits, self.args.logit_softcap)


def one_graph(args: ModelArgs) -> bool:
    """Whether a forward of this shape can be captured as one CUDA graph (builders/draft_graphs.py; the planner
    counts such a draft's graph memory): no sliding-window layer (one dense span mask carries no window), no
    routed layer (which experts run depends on each pass's routing), no layer whose mixer reads the tree itself
    (a recurrent state's scratch is found by slot, and a dense span mask is not a tree)."""
    return not (any(kind.window for kind in args.layer_kinds) or args.moe is not None or has_tree_plans(args))


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping; x unchanged when cap is None)."""
    return x if cap is None else torch.tanh(x / cap) * cap


def _rope_buffer(rope: str) -> str:
    """The buffer holding one RoPE's inverse frequencies: inv_freq, inv_freq_local."""
    return "inv_freq" if rope == "global" else f"inv_freq_{rope}"


def prefix_tree_mask(n_prefix: int, tree_mask: torch.Tensor, window: int | None = None,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
    """Attention mask [1, 1, T, n_prefix + T] for T new tokens after a committed prefix: all of the prefix
    plus the token's own ancestors `tree_mask` [T, T] (a lower-triangular matrix for a plain sequence).
    With a sliding `window`, keys further back than window - 1 positions are hidden (positions [T] needed)."""
    T = tree_mask.shape[0]
    left = torch.ones(T, n_prefix, dtype=torch.bool, device=tree_mask.device)
    mask = torch.cat([left, tree_mask], dim=1)
    if window is not None and positions is not None:
        key_pos = torch.cat([torch.arange(n_prefix, device=positions.device), positions])
        mask &= (positions.unsqueeze(1) - key_pos.unsqueeze(0)) < window
    return mask.view(1, 1, T, n_prefix + T)


# Optional abilities of a model the engine runs (checked with specexec.abilities.has; a plain Transformer has
# MakesCache only, an offloaded target all four, a wrapped draft such as vocab_trim.TrimmedDraft none).
@runtime_checkable
class MakesCache(Protocol):
    """A model that makes its own KV cache (an offloaded target streams some layers' rows)."""

    def new_cache(self, capacity: int, quant: str = "none", tail: int = 0) -> KVCache: ...


@runtime_checkable
class PlansPrefill(Protocol):
    """A streamed target: one prefill pass streams the whole model, so it takes as many prompt tokens as its
    memory plan allows (`prefill_tokens`)."""

    prefill_tokens: int


@runtime_checkable
class Closes(Protocol):
    """A model with background work to stop (an offloaded target's pager thread)."""

    def close(self) -> None: ...


@runtime_checkable
class Streams(Protocol):
    """A target whose layers a pager streams; `pager.counters()` gives its cumulative streaming counters."""

    pager: Any
