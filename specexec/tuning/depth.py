"""`--draft-layers auto` for a self-draft: which depth drafts fastest, from measurements of each candidate
depth (docs/algorithms.md §26).

The plan (specexec/planning/ledger.py) says the most layers whose copies fit, k_max: the upper bound. The
candidates are fewer layers of those (depth_ladder: k_max, ~3/4, ~1/2, ~1/3, ~1/4 of it). Each is measured
(specexec/runtime/depth_probe.py): its top-1 agreement `a` with the target and its seconds per drafted token
`t_d`; the target's seconds of a one-row pass `T` and of each further row `r` are measured beside them. Then,
for a chain of l drafted tokens each accepted with probability a independently of the others:

    tokens per step(l)  = 1 + a + a^2 + ... + a^l = (1 - a^(l+1)) / (1 - a)      (l + 1 when a = 1)
    seconds per step(l) = T + l r + l t_d                                          (verify l + 1 rows, draft l)
    tokens/s(depth)     = max over l in 1..MAX_CHAIN of tokens per step(l) / seconds per step(l)

and the depth with the highest tokens/s wins. The target alone emits 1 / T_alone tokens/s (T_alone: its
seconds per token, by default T). When even the best depth is predicted slower than the target alone by more
than MARGIN (the gate's own hysteresis: within it timings are a tie, and the gate would not switch either) the
choice says so (`loses`): the caller keeps the gate on for the run, and the gate stops drafting once it
measures the same (specexec/companions/gate.py).

A chain is the simplest tree; a tree builder only does better at each depth, and does so alike for every depth,
so the ranking is what this model is for, not the absolute rate.

Does not know: models, layers, how anything is timed (callers pass seconds in); no torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_CHAIN = 16                       # the longest chain the model considers
LADDER = (1.0, 3 / 4, 1 / 2, 1 / 3, 1 / 4)   # candidate depths as fractions of the planned k_max
MARGIN = 0.05                        # a prediction this close to the target alone is a tie (gate.Gate.margin)


@dataclass(frozen=True)
class DepthSample:
    """One candidate depth measured: `depth` layers, top-1 `agreement` with the target in [0, 1], and
    `draft_s` seconds per drafted token (one draft pass of one row)."""

    depth: int
    agreement: float
    draft_s: float


@dataclass(frozen=True)
class DepthChoice:
    """The chosen depth of `n_layers`, its measured agreement, the chain length and tokens/s the model predicts
    for it, and the target alone's tokens/s; `loses`: even this depth is predicted slower than the target alone
    by more than MARGIN."""

    depth: int
    n_layers: int
    agreement: float
    chain: int
    tok_s: float
    alone_tok_s: float

    @property
    def speedup(self) -> float:
        return self.tok_s / self.alone_tok_s if self.alone_tok_s > 0 else 0.0

    @property
    def loses(self) -> bool:
        return self.speedup * (1.0 + MARGIN) < 1.0

    def line(self) -> str:
        """'draft depth 7 of 28: agreement 0.62, predicted 1.90x the target alone' (and, when it loses, that
        the gate decides)."""
        out = (f"draft depth {self.depth} of {self.n_layers}: agreement {self.agreement:.2f}, predicted "
               f"{self.speedup:.2f}x the target alone")
        if not self.loses:
            return out
        return out + " (no depth pays: --gate auto turns the gate on, which stops drafting while it loses)"

    def summary(self) -> dict:
        """For stats JSON (Runtime.stats()['draft_depth'])."""
        return {"layers": self.depth, "of": self.n_layers, "agreement": round(self.agreement, 4),
                "chain": self.chain, "predicted_speedup": round(self.speedup, 3), "loses": self.loses}


def depth_ladder(k_max: int, low: int = 2) -> tuple[int, ...]:
    """The candidate depths, deepest first: k_max, ~3/4, ~1/2, ~1/3, ~1/4 of it (rounded), distinct, none below
    `low` (k_max itself when it is below `low`)."""
    if k_max <= low:
        return (k_max,)
    return tuple(sorted({max(low, round(k_max * f)) for f in LADDER}, reverse=True))


def expected_tokens(agreement: float, chain: int) -> float:
    """Tokens one step emits with a chain of `chain` drafted tokens each accepted with probability
    `agreement`: the accepted prefix plus the target's own token."""
    a = min(max(agreement, 0.0), 1.0)
    if a >= 1.0:
        return chain + 1.0
    return (1.0 - a ** (chain + 1)) / (1.0 - a)


def predict(sample: DepthSample, target_s: float, row_s: float = 0.0,
            max_chain: int = MAX_CHAIN) -> tuple[float, int]:
    """(tokens/s, chain length) of `sample`'s depth at its best chain length in 1..max_chain; target_s: the
    target's one-row pass, row_s: each further row of a verification pass."""
    best = (0.0, 1)
    for chain in range(1, max_chain + 1):
        seconds = target_s + chain * (max(row_s, 0.0) + max(sample.draft_s, 0.0))
        if seconds > 0:
            best = max(best, (expected_tokens(sample.agreement, chain) / seconds, chain), key=lambda b: b[0])
    return best


def choose_depth(samples: Sequence[DepthSample], n_layers: int, target_s: float, row_s: float = 0.0,
                 alone_s: float | None = None, max_chain: int = MAX_CHAIN) -> DepthChoice:
    """The depth of `samples` with the highest predicted tokens/s (ties: the shallower), against the target
    alone at 1 / alone_s tokens/s (alone_s None: target_s). ValueError without samples."""
    if not samples:
        raise ValueError("no candidate depth was measured")
    rated = [(predict(s, target_s, row_s, max_chain), s) for s in samples]
    (tok_s, chain), best = max(rated, key=lambda r: (r[0][0], -r[1].depth))
    alone = alone_s if alone_s is not None else target_s
    return DepthChoice(best.depth, n_layers, best.agreement, chain, tok_s, 1.0 / alone if alone > 0 else 0.0)
