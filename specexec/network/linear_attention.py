"""The linear-attention kind of token mixer: Gated DeltaNet (Qwen3-Next, Qwen3.5), with a state per tree branch.

One layer, per token: the input projections (ModelArgs.linear.layout: Qwen3-Next's in_proj_qkvz / in_proj_ba
grouped per key head, or Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a) give the convolution's input
x = [q; k; v], the output gate z, and b, a per value head; a causal depthwise convolution of conv_kernel taps over
x (the token's own input and its path's previous ones), SiLU; q and k L2-normalised, q scaled by dk^-1/2, each key
head serving v_heads / k_heads value heads; beta = sigmoid(b), log-decay g = -exp(A_log) softplus(a + dt_bias);
the gated delta rule (specexec/network/delta_rule.py); an RMSNorm per head gated by SiLU(z); out_proj.

Which tokens a pass sees comes in as a `TreePlan` (built once per forward, `tree_plan`): the committed prefix,
and each new token's ancestors among the scratch slots that follow it (a tree, a draft's growing tree), or a plain
causal run (a prefill chunk: solved in chunks with the state carried, its end state left for `advance`). A tree
node's convolution taps are its own ancestors' inputs (found by position among the slots its mask row shows) and
the committed window; its recurrence starts from the committed state and its ancestors' updates. Its cache is
specexec/kv/recurrent.py (committed state and window, per-slot replay data); without a cache a pass starts from
zeros.

Does not know: attention, RoPE (cos/sin arrive and are ignored), which family a model is, trees beyond a bool
ancestor mask, quantization (a quantized Linear is swapped in from outside).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specexec.config import ModelArgs
from specexec.kv.cache import KVCache
from specexec.kv.recurrent import RecurrentSpec, RecurrentStates
from specexec.network.attention import TreeMask
from specexec.network.delta_rule import CHUNK, Columns, advance_state, causal_pass, tree_pass
from specexec.network.norms import GatedRMSNorm

L2_EPS = 1e-6


@dataclass
class TreePlan:
    """Which tokens each of a forward's T new tokens sees, for recurrent mixers: `prefix` committed slots, then
    `tree` bool [T, K] over the scratch slots [prefix, prefix + K) (each token's ancestors and itself; None: a
    causal run over the T tokens), `positions` [T], `slots` [T] (where each token's scratch goes). `fresh`: the
    tokens sit at slots prefix + 0 .. T - 1 (K = T), so no column of an earlier pass is seen. What every linear
    layer of the forward derives alike (the convolution's taps) is kept in `memo`."""

    prefix: int
    tree: Tensor | None
    positions: Tensor
    slots: Tensor
    fresh: bool
    memo: dict = field(default_factory=dict)

    def taps(self, pos: Tensor, kernel: int) -> Tensor:
        """For the convolution's taps m = 1 .. kernel - 1 (the input m positions up a node's path): where each
        node finds it [m, T], in the rows of the committed window ([0, kernel - 1), oldest first) followed by the
        K columns (pos [K]: their positions): a column its mask row shows, else the window."""
        if "taps" not in self.memo:
            want = self.positions[None, :] - torch.arange(1, kernel, device=pos.device)[:, None]     # [m, T]
            sel = self.tree[None] & (pos[None, None, :] == want[..., None])                          # [m, T, K]
            window = (want - self.prefix + kernel - 1).clamp(0, kernel - 2)
            column = sel.to(torch.int8).argmax(-1) + kernel - 1
            self.memo["taps"] = torch.where(sel.any(-1), column, window)
        return self.memo["taps"]


def tree_plan(mask: TreeMask | Tensor | None, positions: Tensor, slots: Tensor | None) -> TreePlan:
    """The TreePlan of a forward (mask as Transformer.forward takes it; positions [B, T]: B > 1 only for a causal
    pass without a cache; slots None: the default, consecutive from the prefix); a dense mask is refused."""
    if isinstance(mask, Tensor):
        raise ValueError("linear-attention layers need a TreeMask (which slots are ancestors), not a dense mask")
    tm = mask if mask is not None else TreeMask(0)
    if positions.shape[0] != 1 and (tm.tree is not None or tm.prefix):
        raise ValueError(f"linear-attention layers run one sequence over a cache, not a batch of {positions.shape[0]}")
    T = positions.shape[1]
    fresh = slots is None and (tm.tree is None or tm.tree.shape[1] == T)
    if slots is None:
        slots = torch.arange(tm.prefix, tm.prefix + T, device=positions.device)
    return TreePlan(tm.prefix, tm.tree, positions[0], slots, fresh)


def spec_of(args: ModelArgs) -> RecurrentSpec:
    la = args.linear
    return RecurrentSpec(la.k_heads, la.v_heads, la.k_dim, la.v_dim, la.conv_dim, la.conv_kernel, advance_state)


def pass_bytes(args: ModelArgs, tokens: int, context: int, elem: int, device: str, tree: bool = True) -> int:
    """Transient bytes of one linear-attention layer's pass over `tokens` rows (0 without such layers): its
    projections and convolution, q/k/v per value head in fp32, the output and its gate, and the closed form's
    [Hv, T, K] fp32 matrices (decays, key and query scores, the solve) over K columns (a tree: T nodes and
    K = T columns; a causal pass: chunks of delta_rule.CHUNK) with the columns' gathered scratch."""
    la = args.linear
    if la is None:
        return 0
    T, value = tokens, la.v_heads * la.v_dim
    n = T if tree else min(T, CHUNK)
    rows = T * (la.conv_dim * 3 + value * 2 + 2 * la.v_heads) * elem
    heads = T * la.v_heads * (2 * la.k_dim + 3 * la.v_dim) * 4
    scores = 4 * la.v_heads * n * n * 4
    cols = n * (la.k_heads * la.k_dim + la.v_heads * (la.k_dim + la.v_dim) + 2 * la.v_heads + la.conv_dim) * 4
    return rows + heads + scores + cols


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer (the module docstring); parameter names as the checkpoints'."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        la = args.linear
        self.la, self.eps = la, args.norm_eps
        key, value = la.k_heads * la.k_dim, la.v_heads * la.v_dim
        if la.layout == "qkvz":
            self.in_proj_qkvz = nn.Linear(args.dim, 2 * key + 2 * value, bias=False)
            self.in_proj_ba = nn.Linear(args.dim, 2 * la.v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(args.dim, 2 * key + value, bias=False)
            self.in_proj_z = nn.Linear(args.dim, value, bias=False)
            self.in_proj_b = nn.Linear(args.dim, la.v_heads, bias=False)
            self.in_proj_a = nn.Linear(args.dim, la.v_heads, bias=False)
        self.conv1d = nn.Conv1d(la.conv_dim, la.conv_dim, la.conv_kernel, groups=la.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(la.v_heads))
        self.A_log = nn.Parameter(torch.zeros(la.v_heads))
        self.norm = GatedRMSNorm(la.v_dim, args.norm_eps)
        self.out_proj = nn.Linear(value, args.dim, bias=False)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [T, D] -> (convolution input [T, conv_dim] = [q; k; v], z [T, Hv, dv], b [T, Hv], a [T, Hv])."""
        la, T = self.la, x.shape[0]
        if la.layout == "split":
            z = self.in_proj_z(x).view(T, la.v_heads, la.v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = la.v_heads // la.k_heads                      # per key head: [q, k, v (r heads), z (r heads)], [b, a]
        qkvz = self.in_proj_qkvz(x).view(T, la.k_heads, -1)
        q, k, v, z = qkvz.split((la.k_dim, la.k_dim, r * la.v_dim, r * la.v_dim), dim=-1)
        b, a = self.in_proj_ba(x).view(T, la.k_heads, 2 * r).split((r, r), dim=-1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return mixed, z.reshape(T, la.v_heads, la.v_dim), b.reshape(T, -1), a.reshape(T, -1)

    def heads(self, conv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Convolved [T, conv_dim] -> q, k [Hv, T, dk] (normalised, q scaled, key heads repeated per value
        head) and v [Hv, T, dv], fp32."""
        la, T = self.la, conv.shape[0]
        key = la.k_heads * la.k_dim
        q, k, v = conv.float().split((key, key, la.v_heads * la.v_dim), dim=-1)
        r = la.v_heads // la.k_heads
        q, k = (_l2(t.view(T, la.k_heads, la.k_dim)).repeat_interleave(r, dim=1) for t in (q, k))
        q = q * la.k_dim ** -0.5
        return q.transpose(0, 1), k.transpose(0, 1), v.view(T, la.v_heads, la.v_dim).transpose(0, 1)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, plan: TreePlan, cache: KVCache | None, layer: int,
                slots: Tensor | None) -> Tensor:
        """x [1, T, D] -> [1, T, D]; the scratch of a tree pass, or a causal pass's end state, goes to the cache.
        A batch (x [B, T, D]) runs causally without a cache, one sequence after the other."""
        B, T, _ = x.shape
        if B > 1:
            if cache is not None or plan.tree is not None:
                raise ValueError("linear-attention layers run a batch only causally, without a cache")
            return torch.cat([self(x[b:b + 1], cos, sin, plan, None, layer, slots) for b in range(B)])
        mixed, z, b, a = self.project(x[0])
        beta = torch.sigmoid(b).float().transpose(0, 1)                               # [Hv, T]
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)).transpose(0, 1)
        store, j = cache.state(layer) if cache is not None else (None, 0)
        if plan.tree is None:
            o = self._causal(mixed, beta, g, store, j)
        else:
            o = self._tree(mixed, beta, g, plan, store, j)
        o = self.norm(o.transpose(0, 1).to(x.dtype), z)
        return self.out_proj(o.reshape(1, T, -1))

    def _weight(self) -> Tensor:
        return self.conv1d.weight[:, 0]                                                # [conv_dim, taps]

    def _causal(self, mixed: Tensor, beta: Tensor, g: Tensor, store: RecurrentStates | None, j: int) -> Tensor:
        """A causal run from the committed state; its end state and window become the store's pending ones."""
        la, T = self.la, mixed.shape[0]
        window = store.window[j] if store is not None else mixed.new_zeros(la.conv_dim, la.conv_kernel - 1)
        full = torch.cat([window.to(mixed.dtype), mixed.transpose(0, 1)], dim=-1)        # [conv_dim, taps-1+T]
        conv = F.silu(F.conv1d(full[None], self.conv1d.weight, groups=la.conv_dim)[0]).transpose(0, 1)
        q, k, v = self.heads(conv)
        S0 = store.state[j] if store is not None else q.new_zeros(la.v_heads, la.k_dim, la.v_dim)
        o, S = causal_pass(q, k, v, beta, g, S0)
        if store is not None:
            store.set_pending(j, T, S, full[:, full.shape[-1] - window.shape[-1]:])
        return o

    def _tree(self, mixed: Tensor, beta: Tensor, g: Tensor, plan: TreePlan, store: RecurrentStates | None,
              j: int) -> Tensor:
        """A tree pass: each node from the committed state, its ancestors' scratch and its own inputs."""
        la, T = self.la, mixed.shape[0]
        seen, P, dev = plan.tree, plan.prefix, mixed.device
        r = la.v_heads // la.k_heads
        if plan.fresh:                                  # every column is this pass's: nothing to gather
            at, pos, x_c, g_c = None, plan.positions, mixed, g.transpose(0, 1)
        else:
            at = plan.slots - P
            pos, k_c, u_c, g_c, G_c, x_c = store.columns(j, P, seen.shape[1])
            pos = pos.index_copy(0, at, plan.positions)
            x_c = x_c.to(mixed.dtype).index_copy(0, at, mixed)
            g_c = g_c.index_copy(0, at, g.transpose(0, 1))
        window = store.window[j] if store is not None else mixed.new_zeros(la.conv_dim, la.conv_kernel - 1)
        conv = F.silu(self._tree_conv(mixed, x_c, plan.taps(pos, la.conv_kernel), window.to(mixed.dtype)))
        q, k, v = self.heads(conv)
        G = (seen.float() @ g_c).transpose(0, 1)                                       # [Hv, T]
        k_own = k[::r].transpose(0, 1)                                                 # [T, Hk, dk]
        S0 = store.state[j] if store is not None else q.new_zeros(la.v_heads, la.k_dim, la.v_dim)
        if at is None:
            cols = Columns(k, None, G, None)
        else:
            k_c = k_c.index_copy(0, at, k_own).repeat_interleave(r, dim=1).transpose(0, 1)
            new = torch.zeros(seen.shape[1], dtype=torch.bool, device=dev).index_fill_(0, at, True)
            cols = Columns(k_c, u_c.transpose(0, 1), G_c.index_copy(0, at, G.transpose(0, 1)).transpose(0, 1), new)
        o, u = tree_pass(q, k, v, beta, G, S0, seen, cols, at)
        if store is not None:
            store.write(j, P, seen.shape[1], plan.slots, plan.positions, k_own, u.transpose(0, 1),
                        g.transpose(0, 1), G.transpose(0, 1), mixed)
        return o

    def _tree_conv(self, mixed: Tensor, x_c: Tensor, taps: Tensor, window: Tensor) -> Tensor:
        """The convolution of each node over its path: tap m reads the input of the ancestor m positions up
        (a column its mask row shows) or, above the scratch, the committed window (TreePlan.taps). The taps are
        summed in fp32, oldest first, and cast once, as conv1d (the causal pass, prefill) and transformers do: in
        bf16 a product of two bf16 values is exact in fp32, so the result is conv1d's bit for bit."""
        kernel = self.la.conv_kernel
        w = self._weight().float()
        source = torch.cat([window.transpose(0, 1), x_c])                              # [kernel - 1 + K, conv_dim]
        out = mixed.new_zeros(mixed.shape, dtype=torch.float32)                        # [T, conv_dim]
        for m in range(kernel - 1, 0, -1):
            out = out + source[taps[m - 1]].float() * w[:, kernel - 1 - m]
        return (out + mixed.float() * w[:, kernel - 1]).to(mixed.dtype)


def _l2(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)
