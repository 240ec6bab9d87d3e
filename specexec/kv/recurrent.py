"""The cache of linear-attention (Gated DeltaNet) layers: a committed recurrent state per layer, and per slot
beyond it what committing that slot replays (docs/algorithms.md §30).

Per layer:
- committed: the state S [Hv, dk, dv] (fp32) after the committed prefix, and the convolution's window: the
  last conv_kernel - 1 convolution inputs [conv_dim, conv_kernel - 1] (run dtype);
- per scratch slot (a tree node, a draft node): its position, its key k [Hk, dk] (normalised), the update u
  [Hv, dv] it adds to the state along its path, its log-decay g [Hv] and G [Hv] (g summed along its path from
  the committed prefix), and its convolution input x [conv_dim]. Nothing of it depends on the base the path is
  committed from except G, which a commit shifts;
- pending: the state and window after a causal pass (a prefill chunk), which `advance` commits.
Scratch rows live in a ring indexed by slot modulo its size, so a commit moves nothing: the rows of the slots after
the committed ones stay where they are (a draft's root). Every pass names its slot span [prefix, prefix + width)
to `columns` and `write`, which grow the ring first (`reserve`) so that no slot of the span shares a row with
another live slot; each row also records the slot that wrote it, and `keep` checks that every slot it replays still
owns its row (a cheap check: no host sync on a GPU) — a slot overwritten before its commit would otherwise give
wrong tokens silently (issue 55: a 65-node verification pass over a ring of 64).

`keep(slots)` replays the accepted path: S = exp(G_n) S + sum_j exp(G_n - G_j) k_j u_j^T and the window's last
inputs; no weights. The replay is the kind's (its spec's `advance`: network/delta_rule.advance_state, handed in
by the mixer that makes the spec), so this store knows the data it keeps, not the maths. A state cannot go back: `truncate` returns only to the current length, to 0, into the
latest commit (its states before it are kept, not copied, with the path's replay data: a generation that
accepted tokens past its end), or to the one `snapshot` (the end of the last prompt); `reusable` says which.

Does not know: projections or the maths of a pass or a commit (specexec/network/linear_attention.py,
delta_rule.py), trees beyond slots, how many layers of other kinds the cache holds.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

MIN_RING = 64
STATE_COPIES = 4    # per layer and sequence at most: committed, a prefill chunk's pending end, the latest
                    # commit's states before it, the snapshot


def ring_rows(nodes: int) -> int:
    """Scratch rows the ring holds for passes writing up to `nodes` slots past the committed prefix (a multiple
    of MIN_RING)."""
    return max(MIN_RING, -(-nodes // MIN_RING) * MIN_RING)


@dataclass(frozen=True)
class RecurrentSpec:
    """One linear-attention layer's state shape (specexec/config.py LinearArgs) and its kind's commit: `advance`
    (state [.., Hv, dk, dv], k [.., Hv, n, dk], u [.., Hv, n, dv], G [.., Hv, n]) -> the state after the n
    nodes of a path (network/delta_rule.advance_state)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_dim: int
    conv_kernel: int
    advance: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

    @classmethod
    def new_store(cls, specs: list["RecurrentSpec"], capacity: int, batch: int, dtype: torch.dtype,
                  device: torch.device) -> "RecurrentStates":
        if batch != 1 or len(set(specs)) != 1:
            raise ValueError("recurrent states are kept for one sequence of layers of one shape")
        return RecurrentStates(specs[0], len(specs), dtype, device)

    def state_bytes(self) -> int:
        """Bytes of one committed state (fp32) and its convolution window (fp32 bound)."""
        return 4 * (self.v_heads * self.k_dim * self.v_dim + self.conv_dim * (self.conv_kernel - 1))

    def sequence_bytes(self) -> int:
        """Bytes of the states one layer holds for one sequence at most (STATE_COPIES of state_bytes)."""
        return STATE_COPIES * self.state_bytes()

    def node_bytes(self, elem: int = 4) -> int:
        """Bytes a scratch slot holds: position and owner (int64), k, u, g, G (fp32) and the convolution input
        (run dtype)."""
        return 16 + 4 * (self.k_heads * self.k_dim + self.v_heads * self.v_dim + 2 * self.v_heads) + \
            elem * self.conv_dim


@dataclass
class Commit:
    """The latest commit of a store: the states before it (`length` tokens) and, for an accepted path (not a
    prefill), its replay data in order (k [n_layers, Hv, n, dk], u [.., n, dv], G [.., n] from that base, x
    [n_layers, conv_dim, n]), so the cache can return to any point of that path (`replay`)."""

    length: int
    state: Tensor
    window: Tensor
    k: Tensor | None = None
    u: Tensor | None = None
    G: Tensor | None = None
    x: Tensor | None = None

    def replay(self, m: int, advance: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> tuple[Tensor, Tensor]:
        """(state, window) after the first m nodes of the path from the states before it (advance: the kind's)."""
        if m == 0:
            return self.state, self.window
        state = advance(self.state, self.k[:, :, :m], self.u[:, :, :m], self.G[:, :, :m])
        inputs = torch.cat([self.window, self.x[:, :, :m]], dim=-1)
        return state, inputs[..., inputs.shape[-1] - self.window.shape[-1]:].contiguous()


class RecurrentStates:
    """The states of n linear-attention layers of one shape (see the module docstring)."""

    spec_type = RecurrentSpec

    def __init__(self, spec: RecurrentSpec, n: int, dtype: torch.dtype, device: torch.device) -> None:
        self.spec, self.n, self.dtype, self.device = spec, n, dtype, torch.device(device)
        s = spec
        self.state = torch.zeros(n, s.v_heads, s.k_dim, s.v_dim, device=device)
        self.window = torch.zeros(n, s.conv_dim, s.conv_kernel - 1, dtype=dtype, device=device)
        self._alloc_ring(MIN_RING)
        self.pending: tuple[int, Tensor, Tensor] | None = None       # (tokens, state, window) of a causal pass
        self.saved: tuple[int, Tensor, Tensor] | None = None          # (length, state, window): snapshot
        self.last: Commit | None = None                               # the latest commit, to return into it

    def _alloc_ring(self, size: int) -> None:
        s, n, dev = self.spec, self.n, self.device
        self.ring = size
        self.pos = torch.full((size,), -1, dtype=torch.long, device=dev)
        self.owner = torch.full((size,), -1, dtype=torch.long, device=dev)     # the slot whose rows a row holds
        self.k = torch.zeros(n, size, s.k_heads, s.k_dim, device=dev)
        self.u = torch.zeros(n, size, s.v_heads, s.v_dim, device=dev)
        self.g = torch.zeros(n, size, s.v_heads, device=dev)
        self.G = torch.zeros(n, size, s.v_heads, device=dev)
        self.x = torch.zeros(n, size, s.conv_dim, dtype=self.dtype, device=dev)

    @property
    def nbytes(self) -> int:
        tensors = [self.state, self.window, self.pos, self.owner, self.k, self.u, self.g, self.G, self.x]
        if self.pending is not None:
            tensors += list(self.pending[1:])
        if self.saved is not None:
            tensors += list(self.saved[1:])
        if self.last is not None:
            tensors += [t for t in (self.last.state, self.last.window, self.last.k, self.last.u, self.last.G,
                                    self.last.x) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------------------------- a pass's side

    def reserve(self, last_slot: int, length: int) -> None:
        """Make the ring hold every slot up to `last_slot` beside the live ones from `length` (grows it)."""
        need = last_slot - length + 1
        if need <= self.ring:
            return
        size = ring_rows(need)
        live = torch.arange(length, length + self.ring, device=self.device)
        old = (self.pos, self.owner, self.k, self.u, self.g, self.G, self.x)
        rows = live % self.ring
        self._alloc_ring(size)
        dest = live % size
        self.pos[dest] = old[0][rows]
        self.owner[dest] = old[1][rows]
        for new, was in zip((self.k, self.u, self.g, self.G, self.x), old[2:]):
            new[:, dest] = was[:, rows]

    def columns(self, layer: int, prefix: int, width: int) -> tuple[Tensor, ...]:
        """The scratch of slots [prefix, prefix + width) of one layer: pos [K], k [K, Hk, dk], u [K, Hv, dv],
        g, G [K, Hv], x [K, conv_dim] (copies; stale rows are finite and masked by the caller)."""
        self.reserve(prefix + width - 1, prefix)
        rows = torch.arange(prefix, prefix + width, device=self.device) % self.ring
        return (self.pos[rows], self.k[layer, rows], self.u[layer, rows], self.g[layer, rows], self.G[layer, rows],
                self.x[layer, rows])

    def write(self, layer: int, prefix: int, width: int, slots: Tensor, pos: Tensor, k: Tensor, u: Tensor,
              g: Tensor, G: Tensor, x: Tensor) -> None:
        """Store a pass's nodes at `slots` [T], all in its span [prefix, prefix + width) (prefix: the committed
        length), growing the ring first so that no row of a live slot is overwritten: pos [T], k [T, Hk, dk],
        u [T, Hv, dv], g, G [T, Hv], x [T, conv_dim]."""
        self.reserve(prefix + width - 1, prefix)
        rows = slots % self.ring
        self.pos[rows] = pos
        self.owner[rows] = slots
        for dst, src in zip((self.k, self.u, self.g, self.G, self.x), (k, u, g, G, x)):
            dst[layer].index_copy_(0, rows, src.to(dst.dtype))

    def set_pending(self, layer: int, tokens: int, state: Tensor, window: Tensor) -> None:
        """The state and window one layer reaches after a causal pass of `tokens` tokens (advance commits)."""
        if self.pending is None or self.pending[0] != tokens:
            self.pending = (tokens, self.state.clone(), self.window.clone())
        self.pending[1][layer] = state
        self.pending[2][layer] = window.to(self.dtype)

    # ------------------------------------------------------------------------------------- commits

    def begin_forward(self, length: int) -> None:
        self.pending = None

    def advance(self, n: int, length: int) -> None:
        if n == 0:
            return
        if self.pending is not None and self.pending[0] == n:
            self.last = Commit(length, self.state, self.window)
            _, self.state, self.window = self.pending
            self.pending = None
            return
        self.keep(torch.arange(length, length + n, device=self.device), length)

    def keep(self, slots: Tensor, length: int) -> None:
        n = int(slots.numel())
        if n == 0:
            return
        if self.pending is not None:
            if n == self.pending[0] and bool((slots == torch.arange(length, length + n, device=slots.device)).all()):
                return self.advance(n, length)
            raise ValueError("a causal pass's tokens are committed in order, all of them (advance)")
        slots = slots.to(self.device)
        rows = slots % self.ring
        _check(self.owner[rows] == slots, "a recurrent scratch slot was overwritten before its commit read it "
               "(a pass wrote past its ring); the state would be wrong")
        group = self.spec.v_heads // self.spec.k_heads
        k = self.k[:, rows].repeat_interleave(group, dim=2).transpose(1, 2)    # [n_layers, Hv, n, dk]
        path = Commit(length, self.state, self.window, k, self.u[:, rows].transpose(1, 2),
                      self.G[:, rows].transpose(1, 2), self.x[:, rows].transpose(1, 2))
        self.state, self.window = path.replay(n, self.spec.advance)
        self.last = path                                    # the states before it: not copied, replaced
        self.G -= self.G[:, rows[-1:]].clone()  # live rows after the path: decay from the new base (no .item())

    def truncate(self, length: int, current: int) -> None:
        self.pending = None
        if length == current:
            return
        last, self.last = self.last, None
        if length == 0:
            self.state, self.window = torch.zeros_like(self.state), torch.zeros_like(self.window)
        elif last is not None and last.length <= length and (last.k is not None or last.length == length):
            self.state, self.window = last.replay(length - last.length, self.spec.advance)
        elif self.saved is not None and self.saved[0] == length:
            self.state, self.window = self.saved[1].clone(), self.saved[2].clone()
        else:
            raise ValueError(f"a recurrent state cannot return from {current} to {length} tokens (it can to "
                             f"{self.reusable(length, current)}); prefill again")

    def reusable(self, length: int, current: int) -> int:
        if length >= current:
            return current
        last = self.last
        if last is not None and last.length <= length and (last.k is not None or last.length == length):
            return length
        return self.saved[0] if self.saved is not None and self.saved[0] <= length else 0

    def snapshot(self, length: int) -> None:
        self.saved = (length, self.state.clone(), self.window.clone())

    def grow(self, capacity: int) -> None:
        """Nothing grows with the context: the ring grows with the passes (reserve)."""


def _check(ok: Tensor, why: str) -> None:
    """Assert every element of `ok` (bool) without a host sync on a GPU (torch._assert_async there: a failure
    surfaces at a later kernel launch); on the CPU a RuntimeError naming `why`."""
    if ok.device.type == "cpu":
        if not bool(ok.all()):
            raise RuntimeError(why)
    else:
        torch._assert_async(ok.all())
