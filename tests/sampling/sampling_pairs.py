"""The first two tokens after a prompt, for the statistical exactness tests: their exact joint target
distribution (exact_pairs, penalties included: the second token's distribution sees the first) and their counts
over seeded engine runs (sample_pairs), compared with tests/sampling/chi2.py."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specexec.config import SamplingParams
from specexec.constraint import Constraint
from specexec.decoding.engine import Engine
from specexec.sampling import process_logits

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46]


@torch.inference_mode()
def exact_pairs(target, sampling: SamplingParams, ids: Sequence[int] = PROMPT,
                constraint: Constraint | None = None) -> torch.Tensor:
    """Exact joint target distribution [V, V] of the first two sampled tokens after `ids` (with penalties the
    second token's distribution is penalised by the first, the only generated token; with a constraint each
    token's distribution is masked by it after the path before it)."""
    x = torch.tensor(list(ids))
    T = x.numel()
    V = target.args.vocab_size
    first = None if constraint is None else constraint.allowed([()], V, x.device)
    second = None if constraint is None else constraint.allowed([(t,) for t in range(V)], V, x.device)
    logits1 = target.logits(target(x[None], torch.arange(T)[None]))[-1:]
    p1 = process_logits(logits1, sampling, x[None], T, first).exp()[0]
    seqs = torch.cat([x.expand(V, -1), torch.arange(V)[:, None]], dim=1)
    logits = target.logits(target(seqs, torch.arange(T + 1).expand(V, -1))).view(V, T + 1, -1)[:, -1]
    return p1[:, None] * process_logits(logits, sampling, seqs, T, second).exp()


def sample_pairs(engine: Engine, sampling: SamplingParams, trials: int, ids: Sequence[int] = PROMPT,
                 constraint: Callable[[], Constraint] | None = None) -> torch.Tensor:
    """Counts [V, V] of the first two tokens after `ids` over `trials` runs seeded 0, 1, ... (each run under a
    fresh constraint from `constraint` when given)."""
    V = engine.target.args.vocab_size
    counts = torch.zeros(V, V)
    for seed in range(trials):
        fresh = constraint() if constraint is not None else None
        out = [t for s in engine.generate(list(ids), 2, SamplingParams(**{**sampling.__dict__, "seed": seed}),
                                          constraint=fresh) for t in s]
        counts[out[0], out[1]] += 1
    return counts
