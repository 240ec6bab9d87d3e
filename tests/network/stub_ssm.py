"""A Mamba-2-like token-mixer kind for the tests, written as a new kind is: this one module (its args, the mixer,
its state's spec and store, its pass's bytes) and one row (`KIND`, added to network/mixers.MIXERS by the test).

The mixer: u = in_proj(x) [T, E]; a per-channel decay a = -softplus(A_log) [E]; the state s_t = exp(a) s_{t-1} +
u_t along each node's path (a tree node's path: its ancestors, from the committed state); out_proj(s_t). A node at
depth d below the committed prefix sees s = exp(a d) S + sum over its path j of exp(a (d - d_j)) u_j. Its layer
has no feed-forward (`ffn=False`): the layer is the mixer and its residual.

The store keeps the committed state per layer and, per slot, its position, u and log-decay g, so `keep(slots)`
replays an accepted path without weights: S' = exp(sum g) S + sum_j exp(sum_{m > j} g_m) u_j; a causal pass (a
prefill chunk) leaves its end state for `advance`; `snapshot` / `truncate` return to the end of the last prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specexec.config import ModelArgs
from specexec.kv.cache import KVCache
from specexec.network.mixers import MixerKind

NAME = "stub_ssm"
PASS_BYTES = 7 * 10**9                     # what a pass of it is said to hold: the planner must count it


@dataclass(frozen=True)
class StubArgs:
    """The kind's own shape (ModelArgs.mixer_args under NAME): the state's channels."""

    width: int


@dataclass(frozen=True)
class StubSpec:
    width: int

    @classmethod
    def new_store(cls, specs: list, capacity: int, batch: int, dtype: torch.dtype, device) -> "StubStates":
        return StubStates(specs[0].width, len(specs), capacity, torch.device(device))

    def sequence_bytes(self) -> int:
        return 3 * 4 * self.width              # committed, a prefill's pending end, the snapshot

    def node_bytes(self) -> int:
        return 8 + 2 * 4 * self.width          # position, u and g


class StubStates:
    """The committed state of n stub layers and each slot's replay data (module docstring)."""

    spec_type = StubSpec

    def __init__(self, width: int, n: int, capacity: int, device: torch.device) -> None:
        self.state = torch.zeros(n, width, device=device)
        self.pos = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self.u = torch.zeros(n, capacity, width, device=device)
        self.g = torch.zeros(n, capacity, width, device=device)
        self.pending: tuple[int, Tensor] | None = None
        self.saved: tuple[int, Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.state, self.pos, self.u, self.g))

    def write(self, layer: int, slots: Tensor, pos: Tensor, u: Tensor, g: Tensor) -> None:
        need = int(slots.max()) + 1
        if need > self.pos.shape[0]:
            self.grow(need)
        self.pos[slots] = pos
        self.u[layer, slots] = u
        self.g[layer, slots] = g.expand_as(u)

    def columns(self, layer: int, prefix: int, width: int) -> tuple[Tensor, Tensor]:
        if prefix + width > self.pos.shape[0]:
            self.grow(prefix + width)
        return self.pos[prefix:prefix + width], self.u[layer, prefix:prefix + width]

    def set_pending(self, layer: int, tokens: int, end: Tensor) -> None:
        if self.pending is None or self.pending[0] != tokens:
            self.pending = (tokens, self.state.clone())
        self.pending[1][layer] = end

    def begin_forward(self, length: int) -> None:
        self.pending = None

    def advance(self, n: int, length: int) -> None:
        if n and self.pending is not None and self.pending[0] == n:
            self.state, self.pending = self.pending[1], None
        elif n:
            self.keep(torch.arange(length, length + n, device=self.state.device), length)

    def keep(self, slots: Tensor, length: int) -> None:
        if slots.numel() == 0:
            return
        slots = slots.to(self.state.device)
        g, u = self.g[:, slots], self.u[:, slots]                              # [n_layers, n, E]
        after = g.flip(1).cumsum(1).flip(1) - g                                # decay each u meets after it
        self.state = g.sum(1).exp() * self.state + (after.exp() * u).sum(1)

    def truncate(self, length: int, current: int) -> None:
        self.pending = None
        if length == current:
            return
        if length == 0:
            self.state = torch.zeros_like(self.state)
        elif self.saved is not None and self.saved[0] == length:
            self.state = self.saved[1].clone()
        else:
            raise ValueError(f"a stub state cannot return from {current} to {length} tokens")

    def reusable(self, length: int, current: int) -> int:
        if length >= current:
            return current
        return self.saved[0] if self.saved is not None and self.saved[0] <= length else 0

    def snapshot(self, length: int) -> None:
        self.saved = (length, self.state.clone())

    def grow(self, capacity: int) -> None:
        old = self.pos.shape[0]
        if capacity <= old:
            return
        pad = capacity - old
        self.pos = torch.cat([self.pos, self.pos.new_full((pad,), -1)])
        self.u = torch.cat([self.u, self.u.new_zeros(self.u.shape[0], pad, self.u.shape[2])], dim=1)
        self.g = torch.cat([self.g, self.g.new_zeros(self.g.shape[0], pad, self.g.shape[2])], dim=1)


class StubSSM(nn.Module):
    """The stub mixer (module docstring); called as every mixer is."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        width = args.mixer_args_of(NAME).width
        self.in_proj = nn.Linear(args.dim, width, bias=False)
        self.A_log = nn.Parameter(torch.zeros(width))
        self.out_proj = nn.Linear(width, args.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, plan, cache: KVCache | None, layer: int,
                slots: Tensor | None) -> Tensor:
        if x.shape[0] > 1:                           # a batch without a cache: one sequence after the other
            return torch.cat([self(x[b:b + 1], cos, sin, plan, None, layer, slots) for b in range(x.shape[0])])
        u = self.in_proj(x[0]).float()                                          # [T, E]
        a = -F.softplus(self.A_log.float())                                     # [E]
        store, j = cache.state(layer) if cache is not None else (None, 0)
        T, prefix, pos = u.shape[0], plan.prefix, plan.positions
        tree = plan.tree if plan.tree is not None else torch.ones(T, T, dtype=torch.bool, device=u.device).tril()
        if store is not None:
            store.write(j, plan.slots, pos, u, a)
            col_pos, col_u = store.columns(j, prefix, tree.shape[1])
        else:
            col_pos, col_u = pos, u
        depth = (pos - prefix + 1).float()                                      # [T]
        gap = depth[:, None] - (col_pos - prefix + 1).float()[None, :]          # [T, K]
        weight = torch.where(tree[..., None], a * gap[..., None], float("-inf")).exp()      # [T, K, E]
        start = store.state[j] if store is not None else u.new_zeros(u.shape[1])
        s = (a * depth[:, None]).exp() * start + torch.einsum("tke,ke->te", weight, col_u)
        if store is not None and plan.tree is None:
            store.set_pending(j, T, s[-1])
        return self.out_proj(s.to(x.dtype))[None]


def _spec(args: ModelArgs, layer: int) -> StubSpec:
    return StubSpec(args.mixer_args_of(NAME).width)


KIND = MixerKind(NAME, (NAME,), "ssm", lambda args, layer: StubSSM(args), _spec,
                 lambda args, layer, slots, elem, quant: _spec(args, layer).sequence_bytes(), "tree",
                 node_bytes=lambda args, layer, elem: _spec(args, layer).node_bytes(), streams=False,
                 pass_bytes=lambda args, tokens, context, elem, device, tree=True: PASS_BYTES, ffn=False)
