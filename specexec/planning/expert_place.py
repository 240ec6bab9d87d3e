"""Where the routed experts of each streamed sparse layer compute (--experts stream | cpu[:N] | auto): copied to
the compute device as routed (the streamed path), or on the CPU where they lie in RAM (runtime/cpu_experts.py).

Eligible layers: the plan's sparse layers in the RAM tier (an SSD-tier layer's experts are not in RAM: computing
them on the CPU would read the same disk bytes a stream reads; a resident layer holds its experts already).
Costs of one pass of `rows` rows (the tree pass: budget + 1), per eligible layer:

    streamed: the expected expert union not served by the expert cache (planning/experts.py, uniform routing
              prior) x one expert's bytes / the RAM tier's bandwidth (the link on CUDA, a memcpy on a CPU)
    cpu:      rows x top_k expert products, each reading the expert's packed bytes at the CPU's GEMV rate
              (cpu_gemv_bps: $SPECEXEC_CPU_GBPS, `specexec plan --cpu-gbps`, else DEFAULT_CPU_GBPS); an upper
              bound, as rows sharing an expert share its reads. On a CPU the device *is* the CPU: both ways
              compute the same products, so computing in place costs nothing over streaming and saves the copy.

`cpu` takes every eligible layer; `cpu:N` the last N (the first layers' copies overlap with drafting, since the
pager starts reading the next pass's first layers as soon as a pass ends; the last ones' do not); `auto` the
eligible layers where the CPU's cost is lower (all alike under the uniform prior, so all or none).

Does not know: how experts are computed or copied (specexec/runtime/), measured routing (a run learns it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from offload.memory_plan import GB, Plan

from specexec.config import ModelArgs
from specexec.options import parse_experts

DEFAULT_CPU_GBPS = 20.0      # packed bytes per second one CPU GEMV streams: a desktop's DDR5 at about 1/3 of peak
CPU_GBPS_ENV = "SPECEXEC_CPU_GBPS"


def cpu_gemv_bps(given_gbps: float | None = None) -> float:
    """The CPU's expert-product rate in bytes/s: `given_gbps`, else $SPECEXEC_CPU_GBPS, else DEFAULT_CPU_GBPS.
    ValueError (one line) for an unusable environment value."""
    if given_gbps is not None:
        return given_gbps * GB
    raw = os.environ.get(CPU_GBPS_ENV)
    if raw is None:
        return DEFAULT_CPU_GBPS * GB
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${CPU_GBPS_ENV}={raw!r} is not a number of GB/s; unset it or write e.g. 20") from None
    if not 0 < value < 10_000:
        raise ValueError(f"${CPU_GBPS_ENV}={raw!r} must be in (0, 10000) GB/s")
    return value * GB


@dataclass(frozen=True)
class ExpertPlacement:
    """The choice: `cpu_layers` compute their experts on the CPU; the per-layer costs it was made from."""

    mode: str
    count: int | None             # cpu:N's N
    eligible: tuple[int, ...]     # RAM-tier sparse layers
    cpu_layers: tuple[int, ...]
    sparse: int                   # sparse layers in all
    rows: int
    cpu_s: float                  # one eligible layer's CPU seconds per pass
    stream_s: float               # one eligible layer's streamed-expert seconds per pass
    cpu_bps: float
    device: str

    def lines(self) -> list[str]:
        """What `specexec plan` and the load notice print: one line per choice, and why."""
        n, tree = len(self.cpu_layers), f"{self.rows}-row pass"
        why = (f"{tree} = {n * self.cpu_s:.3f} s CPU vs {n * self.stream_s:.3f} s streamed" if n else
               f"{tree} = {self.cpu_s:.4f} s CPU vs {self.stream_s:.4f} s streamed per layer")
        if self.device == "cpu":
            why = (f"the device is the CPU: computing in place saves copying {self.stream_s * len(self.eligible):.3f}"
                   f" s of experts per {tree}")
        where = (f"cpu for {n} of {self.sparse}" if n else f"streamed for all {len(self.eligible)} RAM-tier of "
                 f"{self.sparse}")
        out = [f"experts: {where} sparse layers (--experts {self.flag}): {why}"]
        rest = self.sparse - len(self.eligible)
        if rest:
            out.append(f"  {rest} sparse layers are resident or on the SSD tier: their experts stay on their path")
        if self.device != "cpu":
            out.append(f"  CPU expert rate {self.cpu_bps / GB:.1f} GB/s (${CPU_GBPS_ENV} or --cpu-gbps to change)")
        return out

    @property
    def flag(self) -> str:
        return self.mode + (f":{self.count}" if self.count else "")

    def to_json(self) -> dict:
        return {"mode": self.flag, "cpu_layers": list(self.cpu_layers), "eligible": len(self.eligible),
                "sparse_layers": self.sparse, "rows": self.rows, "cpu_s_per_layer": round(self.cpu_s, 5),
                "stream_s_per_layer": round(self.stream_s, 5), "cpu_gbps": round(self.cpu_bps / GB, 2)}


def place_experts(plan: Plan, args: ModelArgs, text: str, rows: int, cpu_bps: float | None = None
                  ) -> ExpertPlacement | None:
    """The placement --experts `text` asks for under `plan` (None: a dense target, or no sparse layer streams
    its experts from RAM and nothing is asked of the CPU)."""
    mode, count = parse_experts(text)
    parts = plan.needs.parts
    if args.moe is None or parts is None:
        return None
    eligible = tuple(i for i in parts.layers if plan.tiers[i] == "ram")
    bps = cpu_bps if cpu_bps is not None else cpu_gemv_bps()
    reads = parts.reads[min(plan.cached_parts, parts.count)]
    stream_s = reads * parts.each / plan.bandwidths.ram
    cpu_s = 0.0 if plan.device == "cpu" else rows * args.moe.top_k * parts.each / bps
    if mode == "stream" or not eligible:
        chosen: tuple[int, ...] = ()
    elif mode == "cpu":
        chosen = eligible[-count:] if count else eligible
    else:
        chosen = eligible if cpu_s < stream_s else ()
    return ExpertPlacement(mode, count, eligible, chosen, len(parts.layers), rows, cpu_s, stream_s, bps, plan.device)
