"""`specexec bench stream`: how fast decoder layers stream from each tier, and what one pass costs per tree size.

No checkpoint is needed: decoder layers of a real architecture's shapes (Llama-3 70B / 8B / 1B) get random
weights. A few DISTINCT layers are made (quantized layers are random codes with random block scales: the same
bytes and kernels as real ones, without an hour of CPU quantization) and the N streamed layers cycle through
them: the resident and RAM tiers hold the distinct layers once (aliased), while the SSD layers are written as a
layer cache (offload/cache: layers.bin and its manifest) and read through the runtime's own reader
(LayerCache.read_layer: O_DIRECT where the file system allows it, each layer's checksum on its first read), so
every SSD read is a real read by the code a generation runs. The planner places the N layers from --offload and
the budgets exactly as for a real model of N layers, and its plan is printed; the pager streams with the plan's
slots and SSD read-ahead (bounce buffers), as a real run would.

For each tree size T in --tokens: the raw rate of the slowest tier used is measured first (tier_peak_gbps: the
same reader on the same file in the same page-cache state, or a region -> slot copy for RAM), then one forward
pass of T tokens through the N layers runs (no read-ahead carried over from the previous pass). Rows: tokens,
seconds_per_pass (the pager's pass time: CUDA events on the device's clock, host time on CPU),
effective_gbps (bytes streamed / seconds_per_pass), tier_peak_gbps, ratio, stall_fraction (time compute waited
for a layer / seconds_per_pass), copy_busy (time the copy stream moved the pass's bytes / seconds_per_pass),
tier. `--json` prints one line {"rows": [...], ...}.

Does not know: tokens or trees (a pass is T random hidden rows with causal attention), checkpoints.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from offload.cache.packed import write_packed
from offload.cache.store import LayerCache
from offload.memory_plan import Needs, Plan, PlanError
from offload.platform.facilities import drop_cached, open_read
from offload.quant import weights as qweights
from offload.streaming import storage
from offload.streaming.pager import LayerPager
from offload.planner import default_budgets, plan
from offload.streaming.tiers import RamTier, ResidentTier, host_buffer, probe_copy, probe_read
from specexec.config import ModelArgs
from specexec.options import DTYPES, ConfigError, check_choice, check_device, check_integer, choices, parse_size
from specexec.checkpoints.loading import resolve_dtype
from specexec.network.model import Block, on_meta
from specexec.checkpoints.naming import block_tensor_names
from specexec.planning.ledger import ASSUMED
from specexec.planning.sizes import activation_bytes
from specexec.runtime.offloaded import N_BOUNCE, N_SLOTS, OffloadedTransformer

# Llama-3 shapes: hidden, intermediate, heads, kv heads, real layer count.
ARCHS = {"70b": (8192, 28672, 64, 8, 80), "8b": (4096, 14336, 32, 8, 32), "1b": (2048, 8192, 32, 8, 16)}
VOCAB = 256                      # the bench's embedding/head are tiny: only decoder layers are measured
DEFAULT_TOKENS = {"cuda": "1,64,256,1024,4096", "cpu": "1,16,64"}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("stream", help="weight streaming: seconds per pass by tree size, GB/s per tier",
                       description="Stream random-weight decoder layers of a real architecture's shapes through the "
                                   "pager and measure one pass per tree size against the tier's raw bandwidth.")
    p.add_argument("--synthetic", required=True, choices=sorted(ARCHS), help="architecture shapes (Llama-3)")
    p.add_argument("--quant", default="nf4", choices=qweights.FORMATS, help="layer format (default nf4)")
    p.add_argument("--offload", default="ssd", choices=choices("--offload"),
                   help="where the layers live (default ssd; auto = planned from the budgets)")
    p.add_argument("--gpu-budget", metavar="SIZE", help="GPU memory for the plan (default: free minus a margin)")
    p.add_argument("--ram-budget", metavar="SIZE", help="RAM for the plan (default: available minus a margin)")
    p.add_argument("--tokens", metavar="LIST", help="tree sizes, comma-separated (default 1,64,256,1024,4096 on "
                   "CUDA, 1,16,64 on CPU)")
    p.add_argument("--layers", type=int, default=8, metavar="N", help="layers streamed per pass (default 8)")
    p.add_argument("--distinct", type=int, default=2, metavar="D", help="distinct random layers (default 2)")
    p.add_argument("--device", metavar="DEV", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default="auto", metavar="TYPE", help="compute dtype (default auto: bf16 on CUDA, "
                   "fp32 on CPU)")
    p.add_argument("--dir", metavar="DIR", help="where the SSD tier's file goes (default: a temporary directory, "
                   "removed afterwards)")
    p.add_argument("--json", action="store_true", help="print one JSON line with the rows")
    p.add_argument("--plot", metavar="FILE", help="also draw seconds per pass against tree tokens with the bytes "
                   "÷ bandwidth line into FILE.png or FILE.svg (needs matplotlib)")
    return p


def synthetic_args(name: str, n_layers: int) -> ModelArgs:
    dim, inter, heads, kv, _ = ARCHS[name]
    return ModelArgs(family="llama", vocab_size=VOCAB, dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=kv,
                     head_dim=dim // heads, intermediate_size=inter, norm_eps=1e-5, rope_theta=500000.0,
                     max_position_embeddings=131072)


def parse_tokens(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--tokens {text!r}: write tree sizes like 1,64,256") from None
    if not values or any(v < 1 or v > 65536 for v in values):
        raise ConfigError(f"--tokens {text!r}: give one or more sizes between 1 and 65536")
    return values


# ----------------------------------------------------------------------------------------- synthetic layers

def layer_layout(args: ModelArgs, fmt: str, dtype: torch.dtype, device: torch.device | str = "cpu"
                 ) -> storage.LayerLayout:
    """The packed layout of one decoder layer of `args` in format fmt for `device` (from shapes alone)."""
    names, linear = block_tensor_names(args)
    with on_meta():
        shapes = {n: tuple(t.shape) for n, t in Block(args).state_dict().items()}
    specs, meta = qweights.layer_specs({n: (dtype, shapes[n]) for n in names}, fmt, dtype, linear, device=device)
    return storage.plan_layout(specs, meta)


def random_layer(layout: storage.LayerLayout, fmt: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """uint8 [layout.nbytes]: random weights (std 0.02), unit norms, random 4/8-bit codes and block scales
    (int4: scales about 0.006 and zeros about 0, i.e. weights of std ~0.02)."""
    gen = torch.Generator().manual_seed(seed)
    codes = {}
    if fmt != "none":
        codes = qweights.quantize_weight(torch.randn(64, 64, generator=gen), fmt, dtype)[0]
    tensors = {}
    for e in layout.entries:
        shape, dt = e.shape, getattr(torch, e.dtype)
        if e.name.endswith(".code"):
            tensors[e.name] = codes[".code"].to(dt)
        elif e.name.endswith(".qdata"):                  # any bytes are valid codes, whatever the packed dtype
            tensors[e.name] = torch.randint(0, 256, (e.nbytes,), dtype=torch.uint8, generator=gen).view(dt).view(shape)
        elif e.name.endswith(".scales_zeros"):
            tensors[e.name] = torch.stack([0.004 + 0.004 * torch.rand(shape[:-1], generator=gen),
                                           0.002 * torch.randn(shape[:-1], generator=gen)], dim=-1).to(dt)
        elif e.name.endswith(".scale"):
            tensors[e.name] = (0.0005 + 0.0005 * torch.rand(shape, generator=gen)).to(dt)
        elif e.name.endswith(".absmax"):
            tensors[e.name] = (0.01 + 0.04 * torch.rand(shape, generator=gen)).to(dt)
        elif "norm" in e.name:
            tensors[e.name] = torch.ones(shape, dtype=dt)
        else:
            tensors[e.name] = (0.02 * torch.randn(shape, generator=gen)).to(dt)
    buf = host_buffer(layout.nbytes)
    buf.zero_()
    return storage.pack_into(buf, tensors, layout)


class _Remapped:
    """The SSD tier's reader: layer id -> its position in the bench's layer cache of SSD layers, read by the
    cache's own read_layer."""

    def __init__(self, cache: LayerCache, ids: list[int]) -> None:
        self.cache, self.pos = cache, {i: k for k, i in enumerate(ids)}

    def nbytes(self, i: int) -> int:
        return self.cache.nbytes(self.pos[i])

    def read_layer(self, i: int, out: torch.Tensor) -> None:
        self.cache.read_layer(self.pos[i], out)


def _aliased(tier, ids: list[int], distinct: list[torch.Tensor]):
    """Fill `tier`'s D distinct slices and serve layer i from slice i % D."""
    base = [tier.buffers[k] for k in range(len(distinct))]
    for dst, src in zip(base, distinct):
        dst.copy_(src)
    tier.buffers = {i: base[i % len(distinct)] for i in ids}
    return tier


# ----------------------------------------------------------------------------------------- the run

def make_plan(ns: argparse.Namespace, args: ModelArgs, size: int, device: torch.device, dtype: torch.dtype,
              max_tokens: int) -> Plan:
    """The planner's placement of the N layers, as for a real model (activations of the largest pass only)."""
    budgets = default_budgets(str(device))
    gpu = parse_size(ns.gpu_budget, "--gpu-budget") if ns.gpu_budget else budgets.gpu
    ram = parse_size(ns.ram_budget, "--ram-budget") if ns.ram_budget else budgets.ram
    elem = torch.empty((), dtype=dtype).element_size()
    fixed = (("activations", activation_bytes(args, max_tokens, max_tokens, elem, ns.quant)),)
    needs = Needs((size,) * args.n_layers, fixed, N_SLOTS, N_BOUNCE)
    try:
        return plan(needs, device.type, ram, gpu if device.type == "cuda" or ns.gpu_budget else None, ns.offload,
                    ASSUMED[device.type])
    except PlanError as e:
        raise ConfigError(str(e)) from None


class StreamBench:
    """The pager, model and probes of one `bench stream` run. close() removes the SSD file."""

    def __init__(self, args: ModelArgs, the_plan: Plan, fmt: str, device: torch.device, dtype: torch.dtype,
                 distinct: int, directory: str | None) -> None:
        self.args, self.plan, self.device = args, the_plan, device
        layout = layer_layout(args, fmt, dtype, device)
        self.size = layout.nbytes
        layers = [random_layer(layout, fmt, dtype, seed) for seed in range(min(distinct, args.n_layers))]
        self.layout, self.fmt, self.dtype = layout, fmt, dtype
        ids = {t: the_plan.layers_in(t) for t in ("resident", "ram", "ssd")}
        self._tmp = tempfile.TemporaryDirectory(prefix="specexec-bench-", dir=directory) if ids["ssd"] else None
        resident = _aliased(ResidentTier({k: self.size for k in range(len(layers))}, device), ids["resident"],
                            layers) if ids["resident"] else None
        self.ram = _aliased(RamTier({k: self.size for k in range(len(layers))}, device.type == "cuda"), ids["ram"],
                            layers) if ids["ram"] else None
        self.reader = self._write_file(ids["ssd"], layers) if ids["ssd"] else None
        self.ids = ids
        self.tier = "ssd" if ids["ssd"] else "ram" if ids["ram"] else "resident"
        weights = {"embed_tokens.weight": 0.02 * torch.randn(VOCAB, args.dim), "norm.weight": torch.ones(args.dim),
                   "lm_head.weight": 0.02 * torch.randn(VOCAB, args.dim)}
        weights = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}

        def factory(bind) -> LayerPager:
            return LayerPager([self.size] * args.n_layers, device, resident, self.ram, self.reader, ids["ssd"],
                              the_plan.n_slots or N_SLOTS, the_plan.n_bounce or N_BOUNCE, bind)   # the planned depth

        self.model = OffloadedTransformer(args, weights, [layout] * args.n_layers, fmt, factory, prefetch=False)

    def _write_file(self, ssd_ids: list[int], layers: list[torch.Tensor]) -> _Remapped:
        """All SSD layers to one layer cache (layer k = distinct k % D), then dropped from the page cache."""
        need = self.size * len(ssd_ids)
        free = shutil.disk_usage(self._tmp.name).free
        if need + (256 << 20) > free:
            raise ConfigError(f"the SSD tier's file needs {need / 1e9:.2f} GB in {self._tmp.name}, "
                              f"{free / 1e9:.2f} GB free; lower --layers or pass --dir on a larger disk")
        options = {"format": self.fmt, "dtype": qweights.dtype_name(self.dtype), "source": "bench stream (random layers)"}
        cache = write_packed(Path(self._tmp.name) / "cache",
                             [(layers[k % len(layers)], self.layout) for k in range(len(ssd_ids))], options)
        fd = open_read(cache.file)
        try:
            drop_cached(fd, 0, 0)                      # start from a cold page cache
        finally:
            os.close(fd)
        return _Remapped(cache, ssd_ids)

    def probe(self) -> float | None:
        """Raw bytes/s of the slowest tier in use (None when everything is resident)."""
        if self.tier == "ssd":
            return probe_read(self.reader, self.ids["ssd"], host_buffer(self.size, pin=self.device.type == "cuda"))
        if self.tier == "ram":
            dst = torch.empty(self.size, dtype=torch.uint8, device=self.device)
            return probe_copy([self.ram.buffer(i) for i in self.ids["ram"]], dst)
        return None

    def one_pass(self, tokens: int) -> dict:
        """One forward of `tokens` rows; seconds (the pager's pass time: GPU time from CUDA events on CUDA,
        host time on CPU), bytes streamed, stall and copy-busy seconds."""
        x = torch.randint(0, VOCAB, (1, tokens), device=self.device)
        pos = torch.arange(tokens, device=self.device)[None]
        pager = self.model.pager
        before = pager.collect(wait=True).totals()
        with torch.inference_mode():
            self.model(x, pos)
        after = pager.collect(wait=True).totals()        # waits for this pass's events (a benchmark, not a step)
        return {k: after[k] - before[k] for k in ("pass_s", "bytes_streamed", "stall_s", "busy_s")}

    def close(self) -> None:
        self.model.close()
        if self.reader is not None:
            self.reader.cache.close()
        if self._tmp is not None:
            self._tmp.cleanup()


def measure(bench: StreamBench, token_list: list[int]) -> list[dict]:
    """One row per tree size: the tier's raw rate just before, then one pass."""
    bench.one_pass(1)                                   # warm-up: threads, allocator, kernels
    rows = []
    for tokens in token_list:
        peak = bench.probe()
        r = bench.one_pass(tokens)
        seconds = max(r["pass_s"], 1e-9)
        eff = r["bytes_streamed"] / seconds / 1e9
        rows.append({"tokens": tokens, "seconds_per_pass": round(seconds, 4),
                     "effective_gbps": round(eff, 3), "tier_peak_gbps": round(peak / 1e9, 3) if peak else None,
                     "ratio": round(eff / (peak / 1e9), 3) if peak else None,
                     "stall_fraction": round(min(r["stall_s"] / seconds, 1.0), 3),
                     "copy_busy": round(min(r["busy_s"] / seconds, 1.0), 3),
                     "bytes_per_pass": int(r["bytes_streamed"]), "tier": bench.tier})
    return rows


def table(rows: list[dict], title: str):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in ("tokens", "s/pass", "effective GB/s", "tier peak GB/s", "ratio", "stall", "tier"):
        t.add_column(col, justify="left" if col == "tier" else "right")
    for r in rows:
        peak = "–" if r["tier_peak_gbps"] is None else f"{r['tier_peak_gbps']:.2f}"
        ratio = "–" if r["ratio"] is None else f"{r['ratio']:.2f}"
        t.add_row(str(r["tokens"]), f"{r['seconds_per_pass']:.3f}", f"{r['effective_gbps']:.2f}", peak, ratio,
                  f"{100 * r['stall_fraction']:.0f}%", r["tier"])
    return t


def run(ns: argparse.Namespace) -> int:
    from rich.console import Console

    from cli.bench import plot

    figure = plot.check_target(ns.plot)
    device_name = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_device(device_name)
    device = torch.device(device_name)
    check_choice("--dtype", ns.dtype, DTYPES)                # specexec.options: the one place values are checked
    check_integer("--layers", ns.layers, 1, 1024)
    check_integer("--distinct", ns.distinct, 1, 64)
    dtype = resolve_dtype(ns.dtype, device)
    token_list = parse_tokens(ns.tokens or DEFAULT_TOKENS[device.type])
    args = synthetic_args(ns.synthetic, ns.layers)
    size = layer_layout(args, ns.quant, dtype, device).nbytes
    the_plan = make_plan(ns, args, size, device, dtype, max(token_list))
    console = Console(stderr=True, soft_wrap=True)
    console.print(f"{ns.synthetic} layers ({ns.quant}, {size / 1e6:.1f} MB each), {ns.layers} per pass, "
                  f"{min(ns.distinct, ns.layers)} distinct · {device} {str(dtype).removeprefix('torch.')}\n"
                  + the_plan.describe(), highlight=False)
    bench = StreamBench(args, the_plan, ns.quant, device, dtype, ns.distinct, ns.dir)
    try:
        rows = measure(bench, token_list)
    finally:
        bench.close()
    if figure is not None:
        title = f"bench stream · {ns.synthetic} · {ns.quant} · {bench.tier} tier · {device}"
        plot.save(plot.stream_figure(rows, title), figure, rows, title)
        console.print(f"plot written to {figure}", style="dim", highlight=False)
    if ns.json:
        out = {"arch": ns.synthetic, "quant": ns.quant, "device": str(device),
               "dtype": str(dtype).removeprefix("torch."), "layers": ns.layers, "layer_bytes": size,
               "plan": the_plan.summary(), "rows": rows}
        print(json.dumps(out, separators=(",", ":")), flush=True)
    else:
        Console().print(table(rows, f"bench stream · {ns.synthetic} · {ns.quant} · {bench.tier} tier"))
    return 0
