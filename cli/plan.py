"""`specexec plan`: will a run fit, before anything is downloaded or loaded.

Plans the target (+ draft) from config.json alone (a directory holding only config.json is enough; a GGUF
file's metadata also serves) for a GPU given by its memory (--gpu-memory: a card this machine need not have;
omitted: this machine's GPU, or the CPU without one) and a RAM budget, and prints the memory ledger (every
item each tier holds and its bytes), the layers per tier and the predicted seconds per target pass (on a CPU:
the longer of streaming and compute, compute priced by this CPU's kernels as `specexec bench kernels` measured
them, or said to be unknown: specexec/planning/cpu_compute.py), a warning when the plan holds more RAM than
this machine has; exit 0.
When nothing fits: one line saying what falls short and what would fit, exit 2. `--json` prints one line:
{"resident_layers", "streamed_layers": {"ram", "ssd"}, "ledger": {item: bytes}, "predicted_seconds_per_pass" (the
streaming; on a CPU "compute": {"seconds", "pass_seconds", ...}, None where not measured),
"link_gbps", "kv": {where the target's KV rows live, int8 flagged "lossy"}, ...} (plus the ledger by tier, formats,
budgets, prefill tokens, read-ahead depth; for an MoE target "moe": its experts, the expert cache and the
predicted seconds per pass at tree budgets 0 / 16 / 64 / 256 from the expected expert union,
specexec/planning/experts.py).

Does not know: how the ledger is sized (specexec/planning/ledger.py) or how layers are placed (offload/planner.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cpu_kernels.cache_root import default_cache_root
from offload.memory_plan import GB, Bandwidths, PlanError
from offload.platform.mounts import slow_mount_warnings
from offload.planner import default_budgets
from cli.args import add_flag, default_device
from cli.help import LazyHelp
from specexec.options import (ConfigError, budget_options, check_choice, check_experts, check_integer, check_number,
                              choices, parse_size)
from specexec.tuning.plan_pick import AutoStart, auto_start

DEFAULT_GPU_GBPS = 900.0         # GB/s a 24 GB consumer card's memory reads (RTX 3090 936, 4090 1008)
DEFAULT_LINK_GBPS = 25.0          # pinned host -> GPU over PCIe 4.0 x16, as measured by `specexec doctor`


def _assumed() -> dict:
    from specexec.planning.ledger import ASSUMED   # the planner's module imports torch: read when a help shows it

    return ASSUMED


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from specexec.planning.expert_place import CPU_GBPS_ENV
    from specexec.planning.expert_place import DEFAULT_CPU_GBPS

    p = sub.add_parser("plan", help="will it fit? the memory ledger of a run, from config.json alone",
                       description="Plan a run without loading a weight: what every byte of GPU memory (or RAM "
                                   "on a CPU) holds, which target layers stay resident, which stream from RAM "
                                   "or SSD, and the predicted seconds per target pass.")
    add_flag(p, "--model", "", "target: a directory with config.json (nothing else needed), a .gguf file, or a "
             "name from `specexec models` present here (nothing is downloaded)", required=True)
    add_flag(p, "--draft", "none")
    add_flag(p, "--draft-layers")
    p.add_argument("--gpu-memory", metavar="SIZE", help="plan for a GPU with this much memory, e.g. 24GB "
                   "(default: this machine's GPU, or the CPU when there is none)")
    add_flag(p, "--ram-budget")
    add_flag(p, "--device", "cuda with --gpu-memory or a GPU here, else cpu")
    add_flag(p, "--quant", "auto")
    add_flag(p, "--draft-quant")
    add_flag(p, "--offload")
    add_flag(p, "--budget", "64; auto plans for the largest tree it tries, 1024")
    add_flag(p, "--builder", default="specexec")
    for flag in ("--context", "--dtype", "--kv-quant", "--kv-offload"):
        add_flag(p, flag)
    p.add_argument("--link-gbps", type=float, metavar="GB/S", help=LazyHelp(lambda: f"host -> GPU bandwidth (default "
                   f"{DEFAULT_LINK_GBPS:g} on CUDA; on a CPU the RAM tier's copy rate, default "
                   f"{_assumed()['cpu'].ram / GB:g})"))
    p.add_argument("--ssd-gbps", type=float, metavar="GB/S", help=LazyHelp(lambda: "SSD read bandwidth (default: "
                   "what `specexec doctor` measured on the cache root's disk, else "
                   f"{_assumed()['cuda'].ssd / GB:g} with CUDA, {_assumed()['cpu'].ssd / GB:g} on a CPU)"))
    p.add_argument("--gpu-gbps", type=float, metavar="GB/S", help=f"the GPU's memory bandwidth, which prices its "
                   f"compute of a pass (default {DEFAULT_GPU_GBPS:g}, a 24 GB consumer card's)")
    add_flag(p, "--experts", "stream; plan prints what each choice costs")
    p.add_argument("--cpu-gbps", type=float, metavar="GB/S", help="with --experts: bytes per second the CPU's "
                   f"expert GEMV streams (default ${CPU_GBPS_ENV}, else {DEFAULT_CPU_GBPS:g})")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    return p


def _placement(ns: argparse.Namespace, memory: MemoryPlan):
    """Where the experts compute under --experts (planning/expert_place.py; None for a dense target)."""
    from specexec.planning.expert_place import cpu_gemv_bps

    from specexec.planning.expert_place import place_experts

    check_experts(ns.experts or "stream")
    if ns.cpu_gbps is not None:
        check_number("--cpu-gbps", ns.cpu_gbps, low=0.0, high=10_000.0, low_open=True)
    try:
        bps = cpu_gemv_bps(ns.cpu_gbps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return place_experts(memory.plan, memory.shape.target, ns.experts or "stream", memory.shape.budget + 1, bps)


def _device(ns: argparse.Namespace) -> str:
    if ns.device is not None:
        check_choice("--device", ns.device, ("cpu", "cuda"))
        return ns.device
    if ns.gpu_memory is not None:
        return "cuda"
    return default_device()


def _budgets(ns: argparse.Namespace, device: str) -> tuple[int | None, int, str]:
    """(GPU budget, RAM budget, how the GPU budget was found)."""
    from specexec.planning.ledger import card_budget

    ram = parse_size(ns.ram_budget, "--ram-budget") if ns.ram_budget else default_budgets("cpu").ram
    if device == "cpu":
        return None, ram, ""
    if ns.gpu_memory is not None:
        card = parse_size(ns.gpu_memory, "--gpu-memory")
        budget = card_budget(card)
        if budget <= 0:
            raise ConfigError(f"--gpu-memory {ns.gpu_memory} leaves nothing after the CUDA context and a margin; "
                              "pass the card's memory, e.g. 24GB")
        return budget, ram, f"a {card / GB:.2f} GB card"
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("--device cuda but torch sees no CUDA device; pass --gpu-memory SIZE to plan for a card "
                          "this machine does not have")
    return default_budgets("cuda").gpu, ram, "this machine's GPU (free memory now)"


def ssd_rate(ns: argparse.Namespace, device: str) -> tuple[float, str]:
    """(GB/s, where it came from): --ssd-gbps, else what `specexec doctor` measured on the disk under the cache
    root (specexec/tuning/disk_rate.py), else the plan's assumption for the device."""
    from specexec.planning.ledger import ASSUMED
    from specexec.tuning.disk_rate import measured_read_gbps

    if ns.ssd_gbps is not None:
        return ns.ssd_gbps, "--ssd-gbps"
    measured = measured_read_gbps(default_cache_root())
    if measured is not None:
        return measured.gbps, measured.said()
    return ASSUMED[device].ssd / GB, "assumed (`specexec doctor` measures this disk; --ssd-gbps sets it)"


def _bandwidths(ns: argparse.Namespace, device: str) -> Bandwidths:
    from specexec.planning.ledger import ASSUMED

    base = ASSUMED[device]
    link = ns.link_gbps if ns.link_gbps is not None else (DEFAULT_LINK_GBPS if device == "cuda" else base.ram / GB)
    ssd = ssd_rate(ns, device)[0]
    for flag, value in (("--link-gbps", link), ("--ssd-gbps", ssd)):
        check_number(flag, value, low=0.0, high=10_000.0, low_open=True)
    return Bandwidths(ram=link * GB, ssd=ssd * GB)


def _local(spec: str, flag: str) -> Path:
    """The checkpoint `spec` names on this machine (plan downloads nothing); a catalogue name that is not here:
    the config.json shipped for it (SHIPPED_CONFIGS). A Hub id or catalogue name with neither: one line with the
    commands that fetch the config.json plan needs, and plan it."""
    from specexec.checkpoints.loading import resolve_model_path

    from specexec.checkpoints.catalog import find
    from specexec.checkpoints.loading import HUB_ID

    try:
        return resolve_model_path(spec)
    except ConfigError:
        entry = find(spec)
        shipped = entry.shipped_config() if entry is not None else None
        if shipped is not None:                   # the catalogue's own copy of its config.json
            return shipped
        repo = entry.hub if entry is not None else spec if HUB_ID.match(spec) and not Path(spec).exists() else None
        if repo is None:
            raise
    name = repo.rsplit("/", 1)[-1]
    raise ConfigError(f"{flag} {spec}: {repo} is not on this machine and plan downloads nothing; it needs only the "
                      f"config.json: run `hf download {repo} config.json --local-dir {name}` (a gated model needs "
                      f"HF_TOKEN), then `specexec plan {flag} {name}`") from None


def _ssd_said(ns: argparse.Namespace, memory: MemoryPlan) -> str:
    gbps, source = ssd_rate(ns, memory.plan.device)
    return f"{gbps:.2f} GB/s, {source}"


def _quantizable_draft(ns: argparse.Namespace) -> bool:
    """A draft model of its own (not the target's layers, an MTP layer or an EAGLE head) left unquantized."""
    return bool(ns.draft) and not str(ns.draft).startswith(("self", "mtp", "eagle3:")) and (
        ns.draft_quant in (None, "none"))


def _draft_quant_hint(ns: argparse.Namespace, memory: MemoryPlan) -> str:
    """A line when quantizing the draft keeps more target layers resident, with how many ('' otherwise)."""
    if not _quantizable_draft(ns):
        return ""
    fmt = "nf4" if memory.plan.device == "cuda" else "int4"
    try:
        other, _ = plan_for(argparse.Namespace(**{**vars(ns), "draft_quant": fmt}))
    except ConfigError:
        return ""
    now, then = len(memory.plan.layers_in("resident")), len(other.plan.layers_in("resident"))
    if then <= now:
        return ""
    return (f"the draft crowds out the target: --draft-quant {fmt} keeps {then} of {len(memory.plan.tiers)} target "
            f"layers resident instead of {now} ({other.plan.expected_s:.3f} s of streaming per pass instead of "
            f"{memory.plan.expected_s:.3f} s)")


def _shipped_note(ns: argparse.Namespace) -> str:
    """What the plan read its config.json from when it is the catalogue's shipped copy ('' otherwise)."""
    from specexec.checkpoints.catalog import find

    def shipped(spec: str | None) -> bool:        # a catalogue name with no checkpoint here: its shipped copy
        entry = find(spec) if spec else None
        return entry is not None and entry.local_path() is None and entry.shipped_config() is not None

    said = [f"{flag} {spec}" for flag, spec in (("--model", ns.model), ("--draft", ns.draft)) if shipped(spec)]
    return f"config.json of {' and '.join(said)}: the copy shipped with specexec (nothing downloaded)" if said else ""


def _shape(ns: argparse.Namespace, device: str) -> RunShape:
    from specexec.checkpoints.loading import read_args
    from specexec.planning.run_shape import RunShape
    from specexec.planning.run_shape import plan_context

    import torch

    from specexec.checkpoints.loading import resolve_dtype
    from specexec.builders.registry import make_builder

    from specexec.options import is_self_draft, parse_draft_layers
    from specexec.planning.run_shape import with_self_draft
    from specexec.runtime.self_draft import self_draft_shape

    from specexec.drafters.choose import choose
    from specexec.drafters.registry import parse_draft

    t_path = _local(ns.model, "--model")
    target = read_args(t_path)
    own = is_self_draft(ns.draft)
    drafter = choose(parse_draft(ns.draft), t_path, target, headers=False) if ns.draft and not own else None
    if drafter is not None and ns.draft_quant is not None:
        raise ConfigError(f"--draft-quant is for a draft model; the {drafter.kind} drafter runs in the run dtype")
    draft = (drafter.plan_args(target) if drafter is not None else
             read_args(_local(ns.draft, "--draft")) if ns.draft and not own else None)
    layers = parse_draft_layers(ns.draft_layers) if ns.draft_layers is not None else None
    if layers is not None and not own:
        raise ConfigError("--draft-layers applies to --draft self (a draft made of the target's own layers)")
    budget = budget_options(ns.budget).get("budget", 64) if ns.budget is not None else 64
    check_integer("--budget", budget, 1, 16384)
    if ns.context is not None:
        check_integer("--context", ns.context, 16, 10**7)
    for flag, value in (("--dtype", ns.dtype or "auto"),
                        ("--draft-quant", ns.draft_quant or "none"), ("--kv-quant", ns.kv_quant or "none"),
                        ("--kv-offload", ns.kv_offload or "auto")):
        check_choice(flag, value, choices(flag))
    builder = make_builder(ns.builder)
    draft_kv = builder.kv_slots if (draft is not None or own) and builder.needs_draft else None
    dtype = resolve_dtype(ns.dtype or "auto", torch.device(device))
    shape = RunShape(target, draft, dtype, device, budget, plan_context(ns.context, target, draft),
                     (ns.draft_quant or "none") if draft is not None else "none", draft_kv,
                     kv_quant=ns.kv_quant or "none", kv_offload=ns.kv_offload or "auto",
                     drafter=drafter.size() if drafter is not None else None)
    if not own:
        return shape
    if ns.draft_quant is not None:
        raise ConfigError(f"--draft-quant is for a draft model; a self-draft's copies take --draft self:FORMAT "
                          f"(e.g. self:{ns.draft_quant})")
    spec = self_draft_shape(ns.draft, layers, device)
    return with_self_draft(shape, spec.fmt, spec.layers)


def plan_for(ns: argparse.Namespace) -> tuple[MemoryPlan, str]:
    """The memory plan the flags describe, and where the GPU budget came from. ConfigError (one line, what
    would fit) when nothing does."""
    from specexec.planning.cpu_compute import ram_warning
    from specexec.planning.ledger import plan_memory
    from specexec.planning.ledger import what_fits
    from specexec.planning.ledger import with_warnings

    from specexec.planning.target import target_formats

    device = _device(ns)
    quant = ns.quant or "auto"
    check_choice("--quant", quant, choices("--quant"))
    mode = ns.offload or "auto"
    check_choice("--offload", mode, choices("--offload"))
    shape = _shape(ns, device)
    gpu, ram, source = _budgets(ns, device)
    bandwidths = _bandwidths(ns, device)
    formats = target_formats(quant, device)
    try:
        memory = plan_memory(shape, formats, ram, gpu, mode, bandwidths)
    except PlanError as e:
        hint = what_fits(shape, formats, ram, gpu, mode, bandwidths)
        raise ConfigError(_explain(e, ns) + (f"; {hint}" if hint else "; nothing smaller fits either")) from None
    import psutil

    cache = default_cache_root() if memory.fmt != "none" or memory.plan.streams else None
    too_big = ram_warning(memory, psutil.virtual_memory().total)
    warnings = (*slow_mount_warnings(_local(ns.model, "--model"), cache), *([too_big] if too_big else []))
    return with_warnings(memory, warnings), source


def _explain(e: PlanError, ns: argparse.Namespace) -> str:
    """The planner's line, said in terms of --gpu-memory when that is what fell short."""
    from specexec.planning.ledger import card_for

    if e.flag != "--gpu-budget" or ns.gpu_memory is None:
        return str(e)
    return (f"--gpu-memory {ns.gpu_memory} leaves a {e.budget / GB:.2f} GB budget (after the CUDA context and a "
            f"margin), which cannot hold {e.what}: {e.needed / GB:.2f} GB needed, a card of at least "
            f"{card_for(e.needed) / GB:.1f} GB")


def _auto_start(ns: argparse.Namespace, memory: MemoryPlan) -> AutoStart | None:
    """With a draft: what --budget auto would start at, priced by this plan (its pass seconds are flat in
    the tree: streaming)."""
    if not ns.draft or ns.draft == "none":
        return None
    return auto_start(budget_options("auto")["budget"], memory.plan.expected_s)


def _compute(memory: MemoryPlan) -> CpuCompute | None:
    """A CPU plan's compute, priced by this CPU's measured kernels (None on CUDA: hidden behind the copies)."""
    from specexec.planning.cpu_compute import cpu_compute

    import torch

    return cpu_compute(memory, torch.get_num_threads()) if memory.plan.device == "cpu" else None


def gpu_compute_s(memory: MemoryPlan, gbps: float) -> tuple[float, float]:
    """(seconds, weight bytes) of a pass's compute on the GPU: every weight byte it reads (resident and streamed
    layers, the head) at the GPU's memory bandwidth; a decode-sized pass is bound by those reads."""
    from specexec.planning.cpu_compute import HEAD_ITEM, TIERS

    p = memory.plan
    nbytes = sum(p.pass_bytes(t) for t in TIERS) + memory.ledger().get(HEAD_ITEM, 0)
    return nbytes / (gbps * GB), nbytes


def _predicted_line(memory: MemoryPlan, compute: CpuCompute | None, gpu_gbps: float = DEFAULT_GPU_GBPS,
                    ssd: str = "") -> str:
    p = memory.plan
    kv = p.companion_bytes(True)
    moved = f"{(p.pass_bytes('ram') + p.pass_bytes('ssd')) / GB:.2f} GB" + (
        f" of weights and {kv / GB:.2f} GB of KV cache ({len(p.companions_streamed)} layers)" if kv else "")
    layers = f"{len(p.layers_in('resident'))} of {len(p.tiers)} layers resident"
    ssd_said = f"; SSD {ssd}" if ssd and p.pass_bytes("ssd") else ""
    if compute is None:
        seconds, nbytes = gpu_compute_s(memory, gpu_gbps)
        return (f"predicted {max(p.expected_s, seconds):.3f} s per target pass, the longer of streaming and the GPU's "
                f"compute ({layers}; streaming {moved} per pass: {p.expected_s:.3f} s{ssd_said}; compute "
                f"{seconds:.3f} s: {nbytes / GB:.2f} GB of weights read at {gpu_gbps:g} GB/s, --gpu-gbps)")
    total = compute.pass_seconds(p.expected_s)
    if total is None:
        return (f"predicted at least {p.expected_s:.3f} s per target pass, the streaming alone ({layers}; streaming "
                f"{moved} per pass{ssd_said}); {compute.describe()}")
    return (f"predicted {total:.3f} s per target pass, the longer of streaming and compute ({layers}; streaming "
            f"{moved} per pass: {p.expected_s:.3f} s{ssd_said}; {compute.describe()})")


def run(ns: argparse.Namespace) -> int:
    try:
        memory, source = plan_for(ns)
    except ConfigError as e:
        if not _quantizable_draft(ns):
            raise
        fmt = "nf4" if _device(ns) == "cuda" else "int4"
        try:
            other, _ = plan_for(argparse.Namespace(**{**vars(ns), "draft_quant": fmt}))
        except ConfigError:
            raise e from None
        raise ConfigError(f"{e}; or quantize the draft: --draft-quant {fmt} fits ({len(other.plan.layers_in('resident'))}"
                          f" of {len(other.plan.tiers)} target layers resident)") from None
    start = _auto_start(ns, memory)
    placement = _placement(ns, memory)
    compute = _compute(memory)
    if ns.json:
        out = {**memory.to_json(), "by_tier": memory.plan.ledger(),
               **({"experts": placement.to_json()} if placement is not None else {}),
               "device_bytes": memory.plan.device_bytes, "host_bytes": memory.plan.host_bytes,
               "ssd_bytes": memory.plan.tier_bytes("ssd")}
        if start is not None:
            out["auto_budget"] = start.to_json()
        if compute is not None:                   # a CPU: the pass is the longer of streaming and compute
            whole = compute.pass_seconds(memory.plan.expected_s)
            out["compute"] = {**compute.to_json(), "pass_seconds": None if whole is None else round(whole, 4)}
        print(json.dumps(out, separators=(",", ":")), flush=True)
        return 0
    out = sys.stdout
    out.write(memory.describe() + "\n")
    for line in placement.lines() if placement is not None and memory.plan.streams else ():
        out.write(line + "\n")
    if source:
        out.write(f"  GPU budget from {source}\n")
    shipped = _shipped_note(ns)
    if shipped:
        out.write(f"  {shipped}\n")
    gpu_gbps = ns.gpu_gbps if ns.gpu_gbps is not None else DEFAULT_GPU_GBPS
    check_number("--gpu-gbps", gpu_gbps, low=0.0, high=100_000.0, low_open=True)
    out.write(_predicted_line(memory, compute, gpu_gbps, _ssd_said(ns, memory)) + "\n")
    hint = _draft_quant_hint(ns, memory)
    if hint:
        out.write(hint + "\n")
    if start is not None:
        out.write(start.describe() + "\n")
    out.flush()
    return 0
