"""Pearson chi-square p-values for the statistical exactness tests (counts against the target's
probabilities)."""
from __future__ import annotations

import torch


def chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells expected below 5 counts are pooled into one."""
    n = float(counts.sum())
    exp = expected_probs.double().flatten() * n
    obs, small = counts.double().flatten(), exp < 5
    obs = torch.cat([obs[~small], obs[small].sum().reshape(1)])
    exp = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
