"""`specexec doctor`: the one command that checks a machine before a long download.

Reports torch / CUDA / driver, the GPU's name and memory, host -> GPU bandwidth measured (pinned, and
pageable for contrast), the cache directory's sequential read bandwidth with O_DIRECT (a temporary file is
written, read back and removed), whether bitsandbytes' CUDA kernels work (on CUDA a missing bitsandbytes
fails: --quant auto streams NF4 there), free RAM, and runs a tiny random
model (built in a temporary directory) whose greedy output on the GPU must equal the CPU's, resident and
streamed from the SSD tier. On a machine without CUDA it says so and checks the CPU path (resident vs
streamed). Exit 0 when every check passes, 1 when one fails (a mismatch is a bug). `--json`: one line.

Does not know: how the probes measure (offload/platform/probe.py), how models run (specexec.runtime.assembly).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from cpu_kernels.cache_root import default_cache_root
from offload.platform.facilities import missing
from offload.platform.mounts import slow_mount_warnings
from specexec.options import ConfigError, check_integer

PROMPT = "The quick brown fox"
TOKENS = 16                          # greedy tokens of the tiny-model check
H2D_MB, IO_MB = 512, 256             # sizes of the bandwidth probes (MB)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("doctor", help="check this machine: GPU, bandwidths, bitsandbytes, a tiny exact run",
                       description="Check torch/CUDA/driver, GPU memory, host->GPU and SSD bandwidth, "
                                   "bitsandbytes' CUDA kernels, free RAM, and that a tiny model's greedy output "
                                   "on the GPU equals the CPU's.")
    p.add_argument("--cache-dir", metavar="DIR", help="directory whose disk is measured (default: the layer "
                   "cache root, $SPECEXEC_CACHE or ~/.cache/specexec)")
    p.add_argument("--io-mb", type=int, default=IO_MB, metavar="MB", help=f"size of the disk probe (default {IO_MB})")
    p.add_argument("--h2d-mb", type=int, default=H2D_MB, metavar="MB",
                   help=f"size of the host->GPU probe (default {H2D_MB})")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    return p


def _driver() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def cuda_report(h2d_mb: int) -> dict:
    """torch/CUDA versions, driver, and per GPU: name, memory, measured pinned/pageable H2D GB/s (GPU 0)."""
    import torch
    from offload.platform.probe import h2d_gbps

    out: dict = {"torch": torch.__version__, "python": platform.python_version(), "cuda_available":
                 torch.cuda.is_available(), "cuda_version": torch.version.cuda, "driver": None, "gpus": []}
    if not out["cuda_available"]:
        return out
    out["driver"] = _driver()
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        props = torch.cuda.get_device_properties(i)
        out["gpus"].append({"index": i, "name": props.name, "total_bytes": total, "free_bytes": free,
                            "capability": f"{props.major}.{props.minor}"})
    n = h2d_mb << 20
    out["h2d_gbps"] = {kind: round(h2d_gbps(n, kind == "pinned", "cuda:0"), 2) for kind in ("pinned", "pageable")}
    return out


def disk_report(directory: Path, io_mb: int) -> dict:
    """The directory's sequential read GB/s with O_DIRECT (or buffered after dropping the page cache)."""
    from offload.platform.probe import direct_read_gbps

    from specexec.tuning.disk_rate import save_read_gbps

    try:
        gbps, direct = direct_read_gbps(directory, io_mb << 20)
    except OSError as e:
        return {"dir": str(directory), "ok": False, "error": f"{e.strerror or e}"}
    save_read_gbps(directory, gbps)                       # `specexec plan` prices the SSD tier with it
    free = shutil.disk_usage(directory).free
    return {"dir": str(directory), "ok": True, "read_gbps": round(gbps, 2), "o_direct": direct, "free_bytes": free,
            "stand_ins": missing(), "warnings": list(slow_mount_warnings(None, directory))}


BNB_HINT = "install it (pip install bitsandbytes): on CUDA --quant auto streams NF4 layers with its kernels"


def bnb_report() -> dict:
    """bitsandbytes' version and whether its CUDA 4-bit kernels run (None without CUDA). On a CUDA machine a
    missing or broken bitsandbytes is a failure (cuda_kernels False): --quant auto means NF4 there."""
    import torch

    from offload.quant.weights import bnb_functional
    cuda = torch.cuda.is_available()
    try:
        bnbf = bnb_functional()                            # the one import, its foreign warnings silenced
        import bitsandbytes
    except Exception as e:                                 # noqa: BLE001 -- any import failure is the finding
        out = {"version": None, "cuda_kernels": False if cuda else None, "error": f"{type(e).__name__}: {e}"}
        return {**out, "hint": BNB_HINT} if cuda else out
    out = {"version": bitsandbytes.__version__, "cuda_kernels": None}
    if not cuda:
        return out
    try:
        w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
        q, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
        back = bnbf.dequantize_4bit(q, state)
        out["cuda_kernels"] = bool(back.is_cuda and (back.float() - w.float()).abs().max().item() < 1.0)
    except Exception as e:                                 # noqa: BLE001
        out.update(cuda_kernels=False, error=f"{type(e).__name__}: {e}")
    return out


def ram_report() -> dict:
    import psutil

    vm = psutil.virtual_memory()
    return {"total_bytes": vm.total, "available_bytes": vm.available}


def _tokens(target: Path, draft: Path, device: str, cache: Path, offload: str) -> list[int]:
    from specexec.config import EngineConfig, OffloadConfig
    from specexec.runtime.assembly import Runtime

    config = EngineConfig(device=device, dtype="float32", budget=8, max_new_tokens=TOKENS)
    rt = Runtime.load(str(target), str(draft), config,
                      offload=OffloadConfig(offload=offload, quant="none", cache_dir=str(cache)))
    try:
        return [t for step in rt.generate_ids(rt.encode(PROMPT), TOKENS) for t in step]
    finally:
        rt.engine.close()


def tiny_model_report() -> dict:
    """Greedy tokens of a tiny random pair: CPU resident is the reference; with CUDA the GPU resident and the
    GPU streamed (SSD tier) runs must equal it, without CUDA the CPU streamed run must."""
    import torch
    from specexec.checkpoints.demo_models import write_model, write_perturbed

    t0 = time.perf_counter()
    quiet = contextlib.redirect_stderr(io.StringIO())      # progress bars of the checkpoint writer and cache build
    with quiet, tempfile.TemporaryDirectory(prefix="specexec-doctor-") as tmp:
        root = Path(tmp)
        target = write_model(root / "target", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, intermediate=256)
        draft = write_perturbed(root / "draft", target, 0.01)
        ref = _tokens(target, draft, "cpu", root / "cache", "none")
        runs = {"cpu resident": ref}
        if torch.cuda.is_available():
            runs["cuda resident"] = _tokens(target, draft, "cuda", root / "cache", "none")
            runs["cuda streamed (ssd)"] = _tokens(target, draft, "cuda", root / "cache", "ssd")
        else:
            runs["cpu streamed (ssd)"] = _tokens(target, draft, "cpu", root / "cache", "ssd")
    equal = {name: ids == ref for name, ids in runs.items()}
    return {"device": "cuda" if torch.cuda.is_available() else "cpu", "tokens": len(ref), "equal": equal,
            "ok": len(ref) > 0 and all(equal.values()), "seconds": round(time.perf_counter() - t0, 2)}


def version_report() -> dict:
    """specexec's version (the one in specexec/__init__.py)."""
    import specexec

    return {"specexec": specexec.__version__}


def collect(cache_dir: Path, io_mb: int, h2d_mb: int) -> dict:
    report = {"version": version_report(), "cuda": cuda_report(h2d_mb), "disk": disk_report(cache_dir, io_mb), "bitsandbytes": bnb_report(),
              "ram": ram_report(), "tiny_model": tiny_model_report()}
    bnb_ok = report["bitsandbytes"]["cuda_kernels"] is not False
    report["ok"] = bool(report["tiny_model"]["ok"] and report["disk"]["ok"] and bnb_ok)
    return report


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


RUN_WORDS = {"cpu resident": "the CPU with every layer resident",
             "cpu streamed (ssd)": "the CPU streaming its layers from the SSD tier",
             "cuda resident": "the GPU with every layer resident",
             "cuda streamed (ssd)": "the GPU streaming its layers from the SSD tier"}


def tiny_model_words(t: dict) -> str:
    """What the tiny model's runs found, in words: each run against the reference (the first: CPU resident)."""
    words = {name: RUN_WORDS.get(name, name) for name in t["equal"]}
    reference = next(iter(words.values()))
    said = [f"{words[name]} gives the same {t['tokens']} greedy tokens as {reference}" if same else
            f"{words[name]} gives OTHER tokens than {reference} (a bug: please report it)"
            for name, same in list(t["equal"].items())[1:]]
    return "; ".join(said) if said else f"{reference} gave {t['tokens']} greedy tokens"


def describe(r: dict) -> str:
    c, d, b, m, t = r["cuda"], r["disk"], r["bitsandbytes"], r["ram"], r["tiny_model"]
    lines = [f"specexec {r['version']['specexec']}, torch {c['torch']} (python {c['python']})"]
    if not c["cuda_available"]:
        lines.append("CUDA: no CUDA device: checking the CPU path only")
    else:
        lines.append(f"CUDA {c['cuda_version']}, driver {c['driver'] or 'unknown'}")
        lines += [f"GPU {g['index']}: {g['name']} (sm {g['capability']}), {_gb(g['total_bytes'])} total, "
                  f"{_gb(g['free_bytes'])} free" for g in c["gpus"]]
        h = c["h2d_gbps"]
        lines.append(f"host -> GPU: pinned {h['pinned']:.2f} GB/s, pageable {h['pageable']:.2f} GB/s")
    if d["ok"]:
        how = "O_DIRECT" if d["o_direct"] else "buffered (O_DIRECT unsupported here), page cache dropped"
        lines.append(f"disk {d['dir']}: read {d['read_gbps']:.2f} GB/s ({how}), {_gb(d['free_bytes'])} free")
        if d["stand_ins"]:
            lines.append(f"platform: no {', '.join(d['stand_ins'])}: using stand-ins (README: Windows and WSL2)")
        lines += [f"warning: {w}" for w in d["warnings"]]
    else:
        lines.append(f"disk {d['dir']}: FAILED: {d['error']}")
    kern = {None: "not applicable (no CUDA)", True: "loaded", False: f"NOT working ({b.get('error', '')})"}
    lines.append(f"bitsandbytes {b['version'] or 'missing'}: CUDA kernels {kern[b['cuda_kernels']]}"
                 + (f"; {b['hint']}" if b.get("hint") else ""))
    lines.append(f"RAM: {_gb(m['available_bytes'])} available of {_gb(m['total_bytes'])}")
    lines.append(f"tiny model ({t['seconds']:.1f} s): {tiny_model_words(t)}")
    lines.append("all checks passed" if r["ok"] else "some checks FAILED (see above)")
    return "\n".join(lines)


def run(ns: argparse.Namespace) -> int:
    check_integer("--io-mb", ns.io_mb, 1, 1 << 20)
    check_integer("--h2d-mb", ns.h2d_mb, 1, 1 << 20)
    directory = Path(ns.cache_dir).expanduser() if ns.cache_dir else default_cache_root()
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--cache-dir {directory} is not a directory")
    report = collect(directory, ns.io_mb, ns.h2d_mb)
    print(json.dumps(report, separators=(",", ":")) if ns.json else describe(report), flush=True)
    return 0 if report["ok"] else 1
