"""Static builder (Sequoia): the tree shape comes from a dynamic program over a positional acceptance vector;
the draft only fills in the tokens.

Chen et al., "Sequoia" (arXiv 2402.12374). The acceptance vector p_k is the probability
that the k-th child (in sampling order) of an accepted node is the one the target accepts. Under that model a
node's value is the product of p over the child ranks on its path, E[tokens/step] = sum of values, and
`tree_shape` finds the shape of at most `budget` nodes and depth <= max_depth that maximises it (depth-bounded
DP, O(D * K * N^2) once per (budget, depth, vector), vectorised max-plus convolutions, cached).

Drafting, one draft pass per level over the nodes the shape expands: temperature 0 takes each node's top-b
tokens; temperature > 0 draws b children without replacement (Gumbel-top-b of the processed q, draw order),
so the builder declares "without_replacement" and V5 (rrs_wor) with `draft_probs` is exact (Sequoia Alg. 2).
Fewer children appear where q has fewer than b tokens with mass. Node i of the tree under construction is
node i of the shape, every level's index tensors are built once per shape, and the tokens q cannot propose keep
score -inf until the one host sync of the tree drops them (with their subtrees): no sync per pass.

The acceptance vector: DEFAULT_ACCEPTANCE (a plausible profile for a same-family pair), or measured ones from
an acceptance file (`acceptance_file`, the one format of specexec/tuning/acceptance.py: vectors per temperature,
as `specexec bench accept` measures them on a pair), from which each build uses the vector measured at the
temperature nearest to its own. The runtime passes the pair's cached file when it exists.

Does not know: the target, verification, how the acceptance vector was measured.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specexec.config import SamplingParams
from specexec.tree import TokenTree
from specexec.tuning.acceptance import load_table as load_acceptance_table
from specexec.builders.growth import DrawsWithoutReplacement, Growth, draft_passes, host_values, pick_children
from specexec.uploads import upload
from specexec.builders.registry import register

DEFAULT_ACCEPTANCE = (0.60, 0.12, 0.05, 0.03, 0.02, 0.014, 0.01, 0.008,
                      0.006, 0.005, 0.004, 0.003, 0.0025, 0.002, 0.0015, 0.001)


@dataclass(frozen=True)
class Shape:
    """A tree shape in BFS order: parents[i] < i (root -1), count[i] children of node i, which are nodes
    first[i] .. first[i] + count[i] - 1 (child rank = position); log_value[i] = log prod p over the path."""

    parents: tuple[int, ...]
    count: tuple[int, ...]
    first: tuple[int, ...]
    depths: tuple[int, ...]
    log_value: tuple[float, ...]

    @property
    def size(self) -> int:
        return len(self.parents) - 1

    @classmethod
    def from_parents(cls, parents: list[int], log_value: list[float] | None = None) -> "Shape":
        """From BFS-ordered parents (every node's children contiguous, parents[0] = -1)."""
        count, first, depths = [0] * len(parents), [len(parents)] * len(parents), [0] * len(parents)
        for i, p in enumerate(parents[1:], start=1):
            count[p] += 1
            first[p] = min(first[p], i)
            depths[i] = depths[p] + 1
        values = log_value if log_value is not None else [0.0] * len(parents)
        return cls(tuple(parents), tuple(count), tuple(first), tuple(depths), tuple(values))

    def expected_tokens(self) -> float:
        return sum(math.exp(v) for v in self.log_value)


def _maxplus(g: Tensor, f: Tensor, ymax: int) -> tuple[Tensor, Tensor]:
    """h[s] = max(g[s], max_{1<=y<=min(s, ymax)} g[s-y] + f[y]) and the maximising y (0 = g[s]); g, f [S].
    The [S, ymax + 1] candidate matrix is a strided (Toeplitz) view of g padded with -inf: no gather."""
    S = g.numel()
    padded = torch.cat([g.new_full((ymax,), -math.inf), g])            # padded[ymax + j] = g[j]
    cand = padded.as_strided((S, ymax + 1), (1, 1)) + f[:ymax + 1].flip(0)[None, :]   # [s, t]: y = ymax - t
    cand[:, ymax] = g
    best, t = cand.max(dim=1)
    return best, ymax - t


def _dp(n: int, depth: int, acc: tuple[float, ...]) -> tuple[Tensor, Tensor]:
    """F [depth+1, n+2]: best value of a subtree of m nodes (root included) and depth <= l; choice
    [depth+1, K+1, n+1]: the subtree size given to child b at remaining size s (0 = no child b). Sizes of
    children's subtrees never increase with rank in some optimal tree (swap them: p_b <= p_{b-1}), so rank b
    only tries sizes up to n / b: O(D * N^2 * ln K) instead of O(D * N^2 * K)."""
    K, S = len(acc), n + 1
    F = torch.full((depth + 1, n + 2), -math.inf, dtype=torch.float32)
    F[:, 1] = 1.0
    choice = torch.zeros(depth + 1, K + 1, S, dtype=torch.long)
    for l in range(1, depth + 1):
        g = torch.full((S,), -math.inf, dtype=torch.float32)
        g[0] = 0.0
        for b in range(1, K + 1):          # child b's subtree has at most n / b nodes in some optimal tree
            g, choice[l, b] = _maxplus(g, acc[b - 1] * F[l - 1, :S], max(1, n // b))
        F[l, 1:] = 1.0 + g
    return F, choice


@functools.lru_cache(maxsize=64)
def tree_shape(budget: int, max_depth: int, acceptance: tuple[float, ...] = DEFAULT_ACCEPTANCE) -> Shape:
    """The shape of at most `budget` non-root nodes and depth <= max_depth maximising sum of node values."""
    acc = tuple(a for a in acceptance if a > 0)[: max(budget, 1)]
    if budget < 1 or max_depth < 1 or not acc:
        return Shape((-1,), (0,), (1,), (0,), (0.0,))
    F, choice = _dp(budget, max_depth, acc)
    m = int(torch.argmax(F[max_depth, 1:budget + 2])) + 1             # best total size (root included)
    parents, logv = [-1], [0.0]
    queue = [(0, max_depth, m)]
    for node, l, size in queue:                                       # BFS: children are appended in order
        s, kids = size - 1, []
        for b in range(len(acc), 0, -1):
            y = int(choice[l, b, s]) if l > 0 else 0
            if y > 0:
                kids.append(y)
                s -= y
        for rank, y in enumerate(reversed(kids)):
            queue.append((len(parents), l - 1, y))
            parents.append(node)
            logv.append(logv[node] + math.log(acc[rank]))
    return Shape.from_parents(parents, logv)


@register
@dataclass
class StaticBuilder(DrawsWithoutReplacement):
    """Sequoia's DP shape filled by the draft (acceptance statistics are measured offline: the shape is fixed)."""

    acceptance: tuple[float, ...] = DEFAULT_ACCEPTANCE
    acceptance_file: str | None = None
    max_depth: int = 16
    name: str = "static"
    drafting: str = "without_replacement"
    needs_draft: bool = True
    _by_temperature: dict[float, tuple[float, ...]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.acceptance_file is not None:
            self._by_temperature = load_acceptance_table(self.acceptance_file)

    def build(self, draft, root_token: int, budget: int, sampling: SamplingParams,
              rng: torch.Generator | None = None) -> TokenTree:
        """Fill the DP shape for `budget` level by level (one draft pass per level)."""
        shape = self.shape_for(budget, sampling.temperature)
        passes = draft_passes(draft, budget + 1, sampling)
        logq = passes.root(root_token)
        self._q.reset(logq, passes, keep=not sampling.greedy)
        g = Growth(root_token, shape.size + 2, logq.device)          # + a dump slot for unused child ranks
        for i, (parents, counts, dest, k) in enumerate(_levels(shape, logq.device)):
            if i:
                logq = g.expand(passes, parents)
                self._q.add(logq)
            rows, _, tok, lp = pick_children(logq, k, not sampling.greedy, rng, counts)
            g.put(dest, tok, parents[rows], g.scores[parents[rows]] + lp)
        g.n = shape.size + 1
        finite = torch.isfinite(g.scores[:g.n])
        n_keep = int(host_values(finite.sum())[0])                    # the one host sync of the tree
        return g.tree(passes, torch.sort((~finite).to(torch.uint8), stable=True).indices[:n_keep])

    def shape_for(self, budget: int, temperature: float | None = None) -> Shape:
        return tree_shape(budget, self.max_depth, self.vector_for(temperature))

    def vector_for(self, temperature: float | None) -> tuple[float, ...]:
        """The file's vector measured at the temperature nearest to `temperature` (None: 0), else `acceptance`."""
        if not self._by_temperature:
            return tuple(self.acceptance)
        t = 0.0 if temperature is None else float(temperature)
        return self._by_temperature[min(self._by_temperature, key=lambda x: (abs(x - t), x))]


@functools.lru_cache(maxsize=64)
def _levels(shape: Shape, device: torch.device) -> list[tuple[Tensor, Tensor, Tensor, int]]:
    """Per level of `shape` with children: (parents long [b], their child counts long [b], dest long [b * k], k),
    dest[r * k + j] = the shape index of child j of parents[r] (k = the level's largest count), or the dump
    slot shape.size + 1 where j >= that parent's count."""
    out = []
    for depth in range(max(shape.depths) + 1):
        parents = [s for s, d in enumerate(shape.depths) if d == depth and shape.count[s] > 0]
        if not parents:
            break
        k = max(shape.count[s] for s in parents)
        dest = [shape.first[s] + j if j < shape.count[s] else shape.size + 1 for s in parents for j in range(k)]
        counts = [shape.count[s] for s in parents]
        out.append((*(upload(x, device) for x in (parents, counts, dest)), k))
    return out
