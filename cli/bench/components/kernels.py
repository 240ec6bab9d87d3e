"""`specexec bench kernels`: the CPU linears side by side at decode sizes, against the machine's memory bandwidth.

Bandwidth: the compiled probe (cpu_kernels' sx_read) reads a 1 GiB buffer with torch's thread count, best of 5
(without the kernels: torch's max over the same buffer). Candidates, for each projection shape of --shapes and
each row count of --rows: specexec's integer kernels (q4 group 64, q8 per channel), torch's int4 and int8
weight-only kernels (aten._weight_int4pack_mm_for_cpu / _weight_int8pack_mm, bf16 activations), torch.ao's dynamic
quantized linear (int8 weights and activations: fbgemm, x86, onednn where this build has the engine), bf16 and fp32
F.linear (oneDNN / MKL). Each is timed over enough copies of its weight to overflow the last-level cache (a decode
step reads every weight once), best of --reps, back to back in one process; GB/s = weight bytes / seconds.
`--json` prints one line. The rates of the kernels a CPU target runs (ours for int4/int8 layers, fp32 F.linear
for unquantized ones) are kept for `specexec plan` (specexec/tuning/cpu_rates.py), which prices a CPU pass's
compute with them.

Does not know: models, layers, the runtime; how the runtime picks a kernel (offload/quant/linear.py; RUNTIME_KERNELS
names its picks by format).
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from cpu_kernels import ops
from cpu_kernels.build import library, status
from offload.quant import int4 as q_int4
from specexec.options import ConfigError, check_choice, check_integer
from specexec.tuning.cpu_rates import save_rates

SHAPES = {"1.5b": [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960)],
          "0.5b": [(896, 896), (128, 896), (4864, 896), (896, 4864)],
          "7b": [(3584, 3584), (18944, 3584), (3584, 18944)], "tiny": [(64, 128)]}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("kernels", help="CPU linear kernels side by side vs the memory bandwidth",
                       description="Time the CPU's candidate linear kernels (ours, torch's int4/int8, torch.ao "
                                   "dynamic int8, bf16/fp32) at decode sizes against the measured memory "
                                   "bandwidth.")
    p.add_argument("--shapes", default="1.5b", metavar="NAME", help=f"projection shapes: {', '.join(SHAPES)} "
                   "(default 1.5b: Qwen2.5-1.5B's)")
    p.add_argument("--rows", default="1,4,16", metavar="LIST", help="activation rows (tokens), default 1,4,16")
    p.add_argument("--reps", type=int, default=5, metavar="N", help="passes over the copies; the best counts")
    p.add_argument("--copies-mb", type=int, default=256, metavar="MB", help="weight copies per candidate, in MB "
                   "(default 256: far past any last-level cache, as a decode step reads every weight once)")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print one JSON line with the rows")
    return p


def read_gbps(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """The memory read bandwidth (GB/s) with torch's thread count: best of `reps` reads of `nbytes`."""
    buf = torch.ones(nbytes, dtype=torch.uint8)
    lib = library()
    read = (lambda: lib.sx_read(buf.data_ptr(), nbytes, torch.get_num_threads())) if lib else (lambda: buf.max())
    return nbytes / _best(read, reps) / 1e9


def _best(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def kernel_names() -> list[str]:
    """The candidates this torch build offers, in table order."""
    engines = [e for e in ("fbgemm", "x86", "onednn") if e in torch.backends.quantized.supported_engines]
    return (["specexec q4 (int8 act)", "specexec q8 (int8 act)", "torch int4pack (bf16 act)",
             "torch int8pack (bf16 act)"] + [f"torch.ao dynamic int8 ({e})" for e in engines]
            + ["bf16 F.linear", "fp32 F.linear"])


def weight(name: str, n: int, k: int, gen: torch.Generator) -> tuple[int, Callable]:
    """(weight bytes, make(x fp32 [M, K]) -> a call computing x @ W.T) for one random weight of candidate `name`."""
    if name.startswith("specexec q4"):
        c4 = ops.pack_q4(torch.randint(0, 16, (n, k), generator=gen), 64)
        sz = (torch.rand(n, k // 64, 2, generator=gen) * 0.01).bfloat16()
        return c4.numel() + 2 * sz.numel(), lambda x: lambda: ops.q4_linear(x, c4, sz, 64)
    if name.startswith("torch int4pack"):
        p4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen), 1)
        sz_t = (torch.rand(k // 64, n, 2, generator=gen) * 0.01).bfloat16()
        return p4.numel() + 2 * sz_t.numel(), lambda x: _bf16_call(
            lambda xb: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p4, 64, sz_t), x)
    if "q8" in name or "int8pack" in name:
        c8, s8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), torch.rand(n).bfloat16() * 0.01
        if "q8" in name:
            return n * k + 2 * n, lambda x: lambda: ops.q8_linear(x, c8, s8)
        return n * k + 2 * n, lambda x: _bf16_call(lambda xb: torch.ops.aten._weight_int8pack_mm(xb, c8, s8), x)
    w = torch.randn(n, k, generator=gen) * 0.02
    if name.startswith("torch.ao"):
        return n * k + 8 * n, lambda x, e=name.split("(")[1].rstrip(")"): _ao_dynamic(w, e, x)
    if name.startswith("bf16"):
        wb = w.bfloat16()
        return 2 * n * k, lambda x: _bf16_call(lambda xb: F.linear(xb, wb), x)
    return 4 * n * k, lambda x: lambda: F.linear(x, w)


def _bf16_call(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable:
    xb = x.bfloat16()
    return lambda: fn(xb)


def _ao_dynamic(w: torch.Tensor, engine: str, x: torch.Tensor) -> Callable:
    torch.backends.quantized.engine = engine
    lin = torch.ao.nn.quantized.dynamic.Linear(w.shape[1], w.shape[0], bias_=False, dtype=torch.qint8)
    scale = (w.abs().amax(1) / 127).double().clamp(min=1e-8)
    lin.set_weight_bias(torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0,
                                                   torch.qint8), None)

    def call() -> torch.Tensor:
        torch.backends.quantized.engine = engine
        return lin(x)
    return call


def measure(shapes: list[tuple[int, int]], rows: list[int], reps: int, copies_bytes: int = 256 << 20) -> list[dict]:
    """One row per (shape, M, candidate): best seconds per call over copies of the weight that overflow the
    caches, GB/s of weights, and the time over ours (q4)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, k in shapes:
        for name in kernel_names():
            first = weight(name, n, k, gen)
            makes = [first[1]] + [weight(name, n, k, gen)[1] for _ in range(max(0, copies_bytes // first[0] - 1))]
            for m in rows:
                x = torch.randn(m, k, generator=gen)
                calls = [make(x) for make in makes]
                s = _best(lambda: [c() for c in calls], reps) / len(calls)
                out.append({"shape": [n, k], "rows": m, "kernel": name, "us": round(s * 1e6, 1),
                            "weight_bytes": first[0], "gbps": round(first[0] / s / 1e9, 2)})
            del makes
    for r in out:
        ours = next(o for o in out if o["shape"] == r["shape"] and o["rows"] == r["rows"]
                    and o["kernel"].startswith("specexec q4"))
        r["x_ours_q4"] = round(r["us"] / ours["us"], 2)
    return out


def parse_rows(text: str, flag: str = "--rows") -> list[int]:
    """'1,4,16' -> [1, 4, 16]; ConfigError naming `flag` and the bad item otherwise."""
    try:
        rows = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: a comma-separated list of row counts, e.g. 1,4,16") from None
    for r in rows:
        check_integer(flag, r, low=1, high=4096)
    if not rows:
        raise ConfigError(f"{flag} lists no row count")
    return rows


# the candidates a CPU target runs, by its layers' format (offload/quant/linear.py picks them)
RUNTIME_KERNELS = {"int4": "specexec q4 (int8 act)", "int8": "specexec q8 (int8 act)", "none": "fp32 F.linear"}


def keep_rates(results: list[dict]) -> list[str]:
    """Save, per format a CPU target runs, the weight bytes per second of its kernel at each row count (all the
    shapes' bytes over all their seconds), for `specexec plan` (specexec/tuning/cpu_rates.py); the formats kept."""
    kept = []
    for fmt, name in RUNTIME_KERNELS.items():
        mine = [r for r in results if r["kernel"] == name]
        by_rows = {m: [r for r in mine if r["rows"] == m] for m in {r["rows"] for r in mine}}
        rates = {m: sum(r["weight_bytes"] for r in rs) / (sum(r["us"] for r in rs) / 1e6)
                 for m, rs in by_rows.items() if sum(r["us"] for r in rs) > 0}
        if rates:
            save_rates(fmt, torch.get_num_threads(), rates)
            kept.append(fmt)
    return kept


def run(ns: argparse.Namespace) -> int:
    check_choice("--shapes", ns.shapes, tuple(SHAPES))
    rows = parse_rows(ns.rows)
    check_integer("--reps", ns.reps, low=1, high=1000)
    if ns.threads is not None:
        check_integer("--threads", ns.threads, low=1, high=1024)
        torch.set_num_threads(ns.threads)
    console = Console(stderr=True, soft_wrap=True)
    console.print(status(), style="dim", highlight=False, markup=False)
    gbps = read_gbps(min(1 << 30, 4 * ns.copies_mb << 20))
    check_integer("--copies-mb", ns.copies_mb, low=1, high=1 << 16)
    results = measure(SHAPES[ns.shapes], rows, ns.reps, ns.copies_mb << 20)
    kept = keep_rates(results)
    t = Table(title=f"CPU linears · {torch.get_num_threads()} threads · memory read {gbps:.1f} GB/s",
              title_justify="left", show_edge=False, pad_edge=False)
    for col in ("shape", "rows", "kernel", "µs", "GB/s", "% of bandwidth", "× ours q4"):
        t.add_column(col, justify="left" if col in ("shape", "kernel") else "right")
    for r in results:
        t.add_row(f"{r['shape'][0]}x{r['shape'][1]}", str(r["rows"]), r["kernel"], f"{r['us']:.0f}",
                  f"{r['gbps']:.1f}", f"{100 * r['gbps'] / gbps:.0f}", f"{r['x_ours_q4']:.2f}")
    (console if ns.json else Console(soft_wrap=True)).print(t)
    console.print(f"kept for `specexec plan` on this CPU: {', '.join(kept)} weight bytes per second by rows",
                  style="dim", highlight=False, markup=False)
    if ns.json:
        print(json.dumps({"read_gbps": round(gbps, 2), "threads": torch.get_num_threads(), "rows": results,
                          "kernels": status(), "q4_group": q_int4.DEFAULT_GROUP}, separators=(",", ":")))
    return 0
