"""How fast this CPU's linear kernels read weights, as measured here: the rate a CPU plan prices compute with.

`specexec bench kernels` times the kernels a CPU target runs (specexec's int4 and int8 kernels, fp32 F.linear
for unquantized layers) and keeps, per layer format, the weight bytes per second at each row count it timed
(`save_rates`), in one JSON file per kernel fingerprint under <cache root>/cpu_rates/ (specexec/tuning/store.py).
The fingerprint names what the rate depends on: the compiled kernels (their library's name hashes sources,
compiler, flags and CPU, as the cost fingerprint of a CPU target does), torch's thread count and the format.
`compute_seconds` prices a pass: the weight bytes it reads / the rate at its row count (piecewise linear between
measured row counts, the largest one's rate beyond it), or None when nothing was measured for this fingerprint:
the plan then says it cannot predict compute instead of calling it hidden.

Does not know: how the kernels are timed (cli/bench/components/kernels.py), which layers a pass reads (the plan).
"""
from __future__ import annotations

import hashlib

from cpu_kernels.build import status as cpu_kernels_status
from specexec.tuning.store import read_json, store_path, write_json

KIND = "cpu_rates"


def rate_fingerprint(fmt: str, threads: int) -> str:
    """What a measured rate depends on: the compiled kernels (or their absence), the threads, the format."""
    parts = [cpu_kernels_status(), str(threads), fmt]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def save_rates(fmt: str, threads: int, bytes_per_s: dict[int, float]) -> None:
    """Keep the measured weight bytes per second at each row count for `fmt` ("int4", "int8", "none")."""
    fingerprint = rate_fingerprint(fmt, threads)
    write_json(store_path(KIND, fingerprint), {"fingerprint": fingerprint, "format": fmt, "threads": threads,
                                               "bytes_per_s": {str(r): float(v) for r, v in bytes_per_s.items()}})


def load_rates(fmt: str, threads: int) -> dict[int, float] | None:
    """row count -> bytes per second measured on this machine for `fmt` with these kernels; None: never."""
    fingerprint = rate_fingerprint(fmt, threads)
    data = read_json(store_path(KIND, fingerprint))
    if data is None or data.get("fingerprint") != fingerprint:
        return None
    try:
        rates = {int(r): float(v) for r, v in data["bytes_per_s"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return {r: v for r, v in rates.items() if r > 0 and v > 0} or None


def rate_at(rates: dict[int, float], rows: int) -> float:
    """Bytes per second at `rows` rows: seconds per byte interpolated linearly between measured row counts
    (the nearest measured one outside them)."""
    xs = sorted(rates)
    if rows <= xs[0]:
        return rates[xs[0]]
    for x0, x1 in zip(xs, xs[1:]):
        if rows <= x1:
            s0, s1 = 1 / rates[x0], 1 / rates[x1]
            return 1 / (s0 + (s1 - s0) * (rows - x0) / (x1 - x0))
    return rates[xs[-1]]


def compute_seconds(weight_bytes: float, fmt: str, rows: int, threads: int) -> tuple[float, float] | None:
    """(seconds, bytes per second) of a pass of `rows` rows reading `weight_bytes` of `fmt` weights with this
    CPU's measured kernels; None when they were never measured here."""
    rates = load_rates(fmt, threads)
    if rates is None:
        return None
    rate = rate_at(rates, rows)
    return weight_bytes / rate, rate
