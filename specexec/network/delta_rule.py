"""The gated delta rule over a tree of tokens, in closed form: every node's output from the committed state and
its own ancestors only (docs/algorithms.md §30).

The recurrence (Gated DeltaNet, Yang et al. 2024), per value head, state S [dk, dv], token t with key k_t
(L2-normalised), value v_t, query q_t (L2-normalised, times dk^-1/2), beta_t in (0, 1), log-decay g_t <= 0:

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t

Unrolled from a base state S_0 along a path, with G_t the sum of g over the path up to t:

    S_t = exp(G_t) S_0 + sum_{j <= t} exp(G_t - G_j) k_j u_j^T
    u_t + beta_t sum_{j < t} exp(G_t - G_j) (k_t . k_j) u_j = beta_t (v_t - exp(G_t) S_0^T k_t)
    o_t = exp(G_t) S_0^T q_t + sum_{j <= t} exp(G_t - G_j) (q_t . k_j) u_j

"j < t along the path" is "j is an ancestor of t" in a tree, so a tree pass is the chunked form of the delta rule
(the UT transform of DeltaNet's chunked algorithm) with the causal mask replaced by the ancestor mask: one
unit-lower-triangular solve per head over the pass's nodes (listed parents first), and every node sees its
ancestors and nothing else. u_t is what node t adds to the state; it depends on its path only, so it is the same
whichever base the path is later committed from, and committing a path is a sum (`advance_state`): no solve, no
weights. Columns already written by an earlier pass of the same tree (a draft tree grown pass by pass) enter
with their u known.

Does not know: projections, the convolution, where columns are stored (specexec/kv/recurrent.py), trees beyond
a bool ancestor mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

CHUNK = 64          # causal passes (prefill) are solved in chunks of this many tokens, the state carried between


@dataclass
class Columns:
    """The K columns a pass's nodes may see, head-major: k [H, K, dk], G [H, K] (decay summed from the base),
    u [H, K, dv] and `new` bool [K] (columns this pass computes, whose u is solved for; the others' u is known).
    u and new None: every column is this pass's own (K = T, node i in column i)."""

    k: Tensor
    u: Tensor | None
    G: Tensor
    new: Tensor | None


def tree_pass(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, G: Tensor, S0: Tensor, seen: Tensor,
              cols: Columns, at: Tensor | None) -> tuple[Tensor, Tensor]:
    """One pass over T nodes (parents before children) per head: q, k [H, T, dk], v [H, T, dv], beta and G
    [H, T] (fp32), S0 [H, dk, dv], seen bool [T, K] (each node's ancestors and itself among the columns), cols:
    the columns, this pass's k and G already at `at` [T] (each node's own column; None: column i is node i).
    -> (o [H, T, dv], u [H, T, dv])."""
    E = (G[:, :, None] - cols.G[:, None, :]).masked_fill(~seen, float("-inf")).exp()   # [H, T, K]
    EK = E * (k @ cols.k.transpose(-1, -2))                                          # decayed k_t . k_c
    start = torch.exp(G)[..., None]
    rhs = v - start * (k @ S0)
    if cols.u is not None:
        rhs = rhs - (EK * ~cols.new).to(cols.u.dtype) @ cols.u
    A = EK if at is None else EK[:, :, at]
    A = torch.tril(A * beta[..., None], -1) + torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    u = torch.linalg.solve_triangular(A, beta[..., None] * rhs, upper=False, unitriangular=True)
    U = u if cols.u is None else cols.u.index_copy(1, at, u)
    o = start * (q @ S0) + (E * (q @ cols.k.transpose(-1, -2))) @ U
    return o, u


def causal_pass(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, S0: Tensor,
                chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """A plain sequence of T tokens (q, k [H, T, dk], v [H, T, dv], beta, g [H, T]) from S0 [H, dk, dv], solved in
    chunks with the state carried. -> (o [H, T, dv], the state after the last token [H, dk, dv])."""
    H, T, _ = q.shape
    outs, S = [], S0
    for a in range(0, T, chunk):
        b = min(a + chunk, T)
        n = b - a
        G = g[:, a:b].cumsum(-1)
        tril = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        o, u = tree_pass(q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b], G, S, tril, Columns(k[:, a:b], None, G, None),
                         None)
        outs.append(o)
        S = advance_state(S, k[:, a:b], u, G)
    return torch.cat(outs, 1), S


def advance_state(S0: Tensor, k: Tensor, u: Tensor, G: Tensor) -> Tensor:
    """The state after a path from S0 [..., dk, dv]: k [..., n, dk], u [..., n, dv], G [..., n] (the path's decay
    sums from the base, in order) -> exp(G_n) S0 + sum_j exp(G_n - G_j) k_j u_j^T."""
    if k.shape[-2] == 0:
        return S0
    last = G[..., -1:]
    w = torch.exp(last - G)[..., None]
    return torch.exp(last)[..., None] * S0 + (k * w).transpose(-1, -2) @ u
