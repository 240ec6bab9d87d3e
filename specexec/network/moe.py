"""The sparse (mixture-of-experts) feed-forward: a router, then the experts its rows were routed to.

A sparse layer's feed-forward is two calls, so a caller can act between them (a streamed target fetches only
the experts a pass routed to, and counts them, before any expert weight is read: runtime/expert_stream.py):

    routing = mlp.route(h)            # Routing: index [T, k] (which experts each row goes to), weight [T, k]
    out = mlp.combine(h, routing)     # the weighted sum of those experts' outputs (+ the shared expert)

`SparseMLP.forward(h)` is the two in a row. Block (specexec/network/model.py) makes the calls itself and hands
each layer's Routing to the model's routing log (Execution.routing: a RoutingLog; None records nothing) between
them, and lets the log compute the combination (`RoutingLog.combine`: by default `mlp.combine`).

Parameter names, inside a decoder layer (the contract the weight-name mapping, specexec/checkpoints/weight_map.py,
and the layer cache use; the checkpoint's own names are mapped onto these):

    mlp.router.weight [E, D]                    (+ mlp.router.bias [E] with MoEArgs.router_bias)
    mlp.router.e_score_correction_bias [E]      with MoEArgs.score_bias
    mlp.experts.{e}.gate_proj.weight [I, D]     e = 0 .. E-1, I = MoEArgs.expert_dim
    mlp.experts.{e}.up_proj.weight   [I, D]
    mlp.experts.{e}.down_proj.weight [D, I]     (+ .bias of each with MoEArgs.expert_bias)
    mlp.shared_expert.{gate,up,down}_proj.weight   with MoEArgs.shared_dim > 0
    mlp.shared_expert_gate.weight [1, D]        with MoEArgs.shared_gate

Every expert is its own GatedMLP (specexec/network/ffn.py) of three nn.Linear, so quantization
(offload/quant/linear.swap_linears) and binding a layer's packed views work on experts as on any MLP, and one
expert's tensors share the prefix
`mlp.experts.{e}.`. The router and the shared-expert gate are NOT nn.Linear (plain parameters read with
F.linear), so they are never quantized: a quantized router would move the discrete top-k choice.

Computation: the T*k (row, expert) pairs are sorted by expert once; each expert that got rows runs once on
their gathered rows and its weighted output is added back with index_add_, experts in ascending order (the
order transformers adds them in, so fp32 results agree to rounding). Finding which experts got rows is one
host sync per sparse layer and pass.

Does not know: checkpoints and their names, devices, streaming (which experts are resident or where their
bytes come from), trees.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specexec.config import ModelArgs, MoEArgs
from specexec.network.ffn import MLP, GatedMLP
from specexec.network.norms import RMSNorm


@dataclass(frozen=True)
class Routing:
    """One sparse layer's routing of a pass's T rows (B*T flattened): index [T, k] long, the experts each row
    goes to (in top-k order); weight [T, k], their weights in the run dtype."""

    index: Tensor
    weight: Tensor

    def experts(self) -> list[int]:
        """The distinct experts of this pass, ascending (a host sync)."""
        return torch.unique(self.index).tolist()


class RoutingLog:
    """What a model's sparse layers routed to in its latest forward: `layers[i]` is layer i's index [T, k].
    Run the model as Execution(routing=RoutingLog()) to record (Transformer.run_as); `record` is called at each
    sparse layer between its router and its experts, so a subclass can act on a layer's routing before the experts
    run."""

    def __init__(self) -> None:
        self.layers: dict[int, Tensor] = {}

    def begin(self) -> None:
        """A new forward starts: forget the previous one."""
        self.layers = {}

    def record(self, layer: int, routing: Routing) -> None:
        self.layers[layer] = routing.index

    def experts(self, layer: int) -> list[int]:
        """The distinct experts layer `layer` routed to in the latest forward (a host sync)."""
        return torch.unique(self.layers[layer]).tolist()

    def combine(self, layer: int, mlp: "SparseMLP", h: Tensor, routing: Routing) -> Tensor:
        """Layer `layer`'s feed-forward output [B, T, D] after `record`: mlp.combine here; a subclass may
        compute the experts elsewhere (specexec/runtime/expert_stream.py: on the CPU, cpu_experts.py)."""
        return mlp.combine(h, routing)


class Router(nn.Module):
    """Scores every expert for every row and keeps the top k (MoEArgs.router says how scores become weights;
    MoEArgs.score_bias, n_group/topk_group and routed_scale how the k are chosen and scaled)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        m = _moe(args)
        self.kind, self.top_k, self.norm_topk = m.router, m.top_k, m.norm_topk_prob
        self.groups, self.topk_group, self.routed_scale, self.fp32 = m.n_group, m.topk_group, m.routed_scale, \
            m.router_fp32
        self.weight = nn.Parameter(torch.empty(m.n_experts, args.dim))
        self.bias = nn.Parameter(torch.empty(m.n_experts)) if m.router_bias else None
        if m.score_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(m.n_experts))
        if m.router_input_norm:                      # Gemma 4: RMSNorm(x) * scale * dim ** -0.5 goes in
            self.norm = RMSNorm(args.dim, args.norm_eps, weight=False)
            self.scale = nn.Parameter(torch.empty(args.dim))
        if m.per_expert_scale:                       # Gemma 4: a kept weight times its expert's scale
            self.per_expert_scale = nn.Parameter(torch.empty(m.n_experts))
        self.allowed: Tensor | None = None           # bool [E]: the experts a row may go to (None: every one)
        self.row_exact = False                       # told by Block.run_as on a row-exact model: see _logits

    def forward(self, x: Tensor) -> Routing:
        """x [T, D] -> Routing (index [T, k], weight [T, k] in x's dtype); scores in fp32. With `allowed` (a
        draft's copy holding some experts only: specexec/runtime/hot_experts.py) the others score -inf before
        the top-k, so no row goes to them (a row left fewer than k allowed experts in its best groups chooses among
        all its allowed ones); the kept weights are then normalised as the family does."""
        if hasattr(self, "norm"):
            x_in = self.norm(x) * self.scale * x.shape[-1] ** -0.5
        else:
            x_in = x
        logits = self._logits(x_in.float() if self.fp32 else x_in)                  # [T, E]
        if self.kind == "topk_softmax":
            top, index = torch.topk(self._masked(logits), self.top_k, dim=-1)
            return Routing(index, torch.softmax(top.float(), dim=-1).to(x.dtype))
        scores = torch.softmax(logits.float(), dim=-1) if self.kind == "softmax" else torch.sigmoid(logits.float())
        choice = scores
        if hasattr(self, "e_score_correction_bias"):
            choice = scores + self.e_score_correction_bias.float()
        choice = self._group_limited(choice) if self.groups > 1 else self._masked(choice)
        index = torch.topk(choice, self.top_k, dim=-1)[1]
        top = scores.gather(1, index)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        if self.routed_scale != 1.0:
            top = top * self.routed_scale
        if hasattr(self, "per_expert_scale"):
            top = top * self.per_expert_scale[index]
        return Routing(index, top.to(x.dtype))

    def _group_limited(self, choice: Tensor) -> Tensor:
        """choice [T, E] with every expert outside each row's topk_group best groups at -inf; a group scores the
        sum of its two best choice scores (DeepSeek-V3's rule). With `allowed`, the others are -inf too, and a row
        left fewer than top_k experts keeps every allowed one instead."""
        T, E = choice.shape
        grouped = choice.view(T, self.groups, E // self.groups)
        best = torch.topk(grouped.topk(2, dim=-1)[0].sum(-1), self.topk_group, dim=-1)[1]        # [T, topk_group]
        keep = torch.zeros(T, self.groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
        limited = self._masked(grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E))
        if self.allowed is None:
            return limited
        enough = (limited > float("-inf")).sum(-1, keepdim=True) >= self.top_k
        return torch.where(enough, limited, self._masked(choice))

    def _logits(self, x: Tensor) -> Tensor:
        """x [T, D] -> [T, E]. With `row_exact`, each row's scores are a product and a row sum (SharedGate's
        way): a BLAS GEMM's rounding depends on the number of rows and a GEMV's on the weight's address, so a
        tree pass would give a row other scores (at a near-tie, other experts) than its one-token pass, and a
        streamed copy of the router other ones than a resident copy; a row-exact model (int4/int8 on a CPU)
        must not."""
        weight = self.weight.float() if self.fp32 else self.weight
        bias = None if self.bias is None else self.bias.float() if self.fp32 else self.bias
        if not self.row_exact:
            return F.linear(x, weight, bias)
        if not x.shape[0]:
            return x.new_zeros(0, weight.shape[0])
        out = torch.stack([(row * weight).sum(-1) for row in x])
        return out if bias is None else out + bias

    def _masked(self, scores: Tensor) -> Tensor:
        """scores [T, E] with the experts `allowed` excludes at -inf (they lose every top-k)."""
        if self.allowed is None:
            return scores
        return scores.masked_fill(~self.allowed.to(scores.device), float("-inf"))


class SharedGate(nn.Module):
    """The shared expert's scalar gate: sigmoid(x . w) per row, weight [1, D] (not an nn.Linear: never quantized).
    Computed as a product and a row sum, not F.linear: a one-column GEMV's rounding follows the weight's address
    (BLAS peels unaligned heads), so a resident and a streamed copy of the same weight would differ in the last
    bit; the row sum's order is fixed by the index alone."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, dim))

    def forward(self, x: Tensor) -> Tensor:
        """x [..., D] -> [..., 1]."""
        return torch.sigmoid((x * self.weight[0]).sum(-1, keepdim=True))


class SparseMLP(nn.Module):
    """The routed feed-forward of one sparse layer: router, experts.{e}, optional shared expert and its gate;
    with MoEArgs.parallel_dense (Gemma 4) also the layer's dense MLP (`dense`, twice as wide in a layer sharing
    K/V when ModelArgs.wide_shared_mlp) and the branches' norms: dense = dense_out_norm(dense(dense_in_norm(h))),
    experts read expert_in_norm(h) and their sum goes through expert_out_norm; the output is their sum."""

    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        m = _moe(args)
        self.router = Router(args)
        self.experts = nn.ModuleList(
            GatedMLP(args.dim, m.expert_dim, m.expert_bias, m.activation, m.swiglu_alpha, m.swiglu_limit)
            for _ in range(m.n_experts))
        if m.shared_dim:
            self.shared_expert = GatedMLP(args.dim, m.shared_dim)
            if m.shared_gate:
                self.shared_expert_gate = SharedGate(args.dim)
        if m.parallel_dense:
            norm = lambda: RMSNorm(args.dim, args.norm_eps, args.norm_plus_one)     # noqa: E731
            self.dense = MLP(args, layer)
            self.dense_in_norm, self.dense_out_norm = norm(), norm()
            self.expert_in_norm, self.expert_out_norm = norm(), norm()

    def route(self, h: Tensor) -> Routing:
        """h [B, T, D] (the post-attention norm's output; with a dense branch beside, the residual stream) -> the
        routing of its B*T rows."""
        return self.router(h.reshape(-1, h.shape[-1]))

    def expert_input(self, x: Tensor) -> Tensor:
        """x [T, D] -> what the experts read: x, or with a dense branch beside, expert_in_norm(x)."""
        return self.expert_in_norm(x) if hasattr(self, "expert_in_norm") else x

    def combine(self, h: Tensor, routing: Routing, experts: Sequence[nn.Module] | None = None) -> Tensor:
        """h [B, T, D] and its routing -> [B, T, D]: each row's experts' outputs weighted by the routing, plus
        the shared expert (or the dense branch). `experts[e]` computes expert e (default: this layer's own; a
        streaming caller may pass modules bound to wherever the routed experts' weights are; only routed ones
        are called)."""
        x = h.reshape(-1, h.shape[-1])
        return self.add_shared(x, self.routed(self.expert_input(x), routing, experts)).view_as(h)

    def routed(self, x: Tensor, routing: Routing, experts: Sequence[nn.Module] | None = None) -> Tensor:
        """x [T, D] -> [T, D]: the routed experts' weighted sum alone (on x's device: a caller computing the
        experts elsewhere, specexec/runtime/cpu_experts.py, passes x and the routing there)."""
        experts = self.experts if experts is None else experts
        out = torch.zeros_like(x)
        k = routing.index.shape[-1]
        flat = routing.index.reshape(-1)                                           # [T*k]
        order = torch.argsort(flat, stable=True)                                   # pairs grouped by expert
        rows, weights = order // k, routing.weight.reshape(-1)[order]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()        # the one host sync
        start = 0
        for e, n in enumerate(counts):
            if n:
                r = rows[start:start + n]
                y = experts[e](x.index_select(0, r)) * weights[start:start + n, None]
                out.index_add_(0, r, y.to(out.dtype))
                start += n
        return out

    def add_shared(self, x: Tensor, out: Tensor) -> Tensor:
        """out [T, D] (the routed sum of x [T, D]'s rows) plus the shared expert, where the family has one (with
        a dense branch beside: the normed routed sum plus the normed dense branch of x)."""
        if hasattr(self, "dense"):
            return self.dense_out_norm(self.dense(self.dense_in_norm(x))) + self.expert_out_norm(out)
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(x)
            if hasattr(self, "shared_expert_gate"):
                shared = self.shared_expert_gate(x) * shared
            out = out + shared
        return out

    def forward(self, h: Tensor) -> Tensor:
        return self.combine(h, self.route(h))


def _moe(args: ModelArgs) -> MoEArgs:
    if args.moe is None:
        raise ValueError(f"a sparse feed-forward needs ModelArgs.moe; this {args.family} config has none")
    return args.moe
