"""--accept's text and values (torch-free: the configs read it): exact | relaxed[:delta=D,k=K], each refusal a
ConfigError about "--accept" (its subject, so a caller maps it to its parameter without reading the message).

Does not know: the model (k's upper bound, the vocabulary, is checked where it is known: relaxed.check_relaxed),
the rules.
"""
from __future__ import annotations

from typing import Any

from specexec.options import about, check_choice, check_integer, check_number

# --accept: how drafted tokens are judged. exact: every rule keeps the target's output (the default); relaxed: LOSSY,
# LANTERN's latent-proximity rule within a total-variation budget delta over the k nearest tokens by input-embedding
# cosine (relaxed.py). Defaults of relaxed's two parameters:
ACCEPT_MODES = ("exact", "relaxed")
RELAXED_DELTA = 0.1
RELAXED_K = 10


def parse_accept(text: str) -> tuple[str, float, int]:
    """'exact' | 'relaxed' | 'relaxed:delta=D,k=K' (either or both, any order) -> (mode, delta, k), checked: delta in
    [0, 1], k >= 1 (its upper bound, the vocabulary, is the model's: the engine checks it). ConfigError naming
    the value and what to write for anything else."""
    raw = str(text).strip()
    mode, sep, rest = raw.partition(":")
    if mode not in ACCEPT_MODES or (sep and mode != "relaxed"):
        raise about("--accept", text, f"unknown --accept {text!r}; choose one of: exact, relaxed, "
                    "relaxed:delta=D,k=K (e.g. relaxed:delta=0.1,k=10)")
    values: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))) if sep else ():
        key, eq, value = part.partition("=")
        if not eq or key.strip() not in ("delta", "k") or key.strip() in values:
            raise about("--accept", text, f"--accept {text!r}: write relaxed:delta=D,k=K (each at most once), "
                        f"not {part!r}")
        values[key.strip()] = value.strip()
    try:
        delta = float(values.get("delta", RELAXED_DELTA))
        k = int(values.get("k", RELAXED_K))
    except ValueError:
        raise about("--accept", text, f"--accept {text!r}: delta must be a number in [0, 1] and k a whole "
                    "number >= 1") from None
    check_accept(mode, delta, k)
    return mode, delta, k


def check_accept(mode: str, delta: Any, k: Any) -> None:
    """ConfigError unless (mode, delta, k) is an --accept value: delta in [0, 1], k >= 1."""
    check_choice("--accept", mode, ACCEPT_MODES)
    check_number("--accept delta", delta, low=0.0, high=1.0)
    check_integer("--accept k", k, low=1, high=10**7)
