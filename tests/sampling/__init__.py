"""Verification rules and sampling: exact greedy and stochastic acceptance, penalties, relaxed acceptance, and the
χ² tests that a speculative run keeps the target's distribution (chi2.py, sampling_pairs.py)."""
