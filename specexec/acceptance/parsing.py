"""--accept's text -> an Acceptance (torch-free): exact | relaxed[:delta=D,k=K], each refusal a ConfigError about
"--accept" (its subject, so a caller maps it to its parameter without reading the message). The values' bounds
and defaults are options.py's (check_accept, RELAXED_DELTA, RELAXED_K: the configs check them, below this
package).

Does not know: the model (k's upper bound, the vocabulary, is checked where it is known: relaxed.check_relaxed),
the rules.
"""
from __future__ import annotations

from specexec.config import Acceptance
from specexec.options import ACCEPT_MODES, RELAXED_DELTA, RELAXED_K, about, check_accept

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


def parse(text: str) -> Acceptance:
    """--accept's text (a flag, a request's "accept" field) -> its Acceptance."""
    return Acceptance(*parse_accept(text))
