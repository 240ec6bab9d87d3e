"""`specexec demo`: the whole path on a small random-weight target/draft pair, with nothing to download.

The pair (a 4-layer, hidden-256 Llama target and the same model with 1% weight noise as the draft) is built
once as real Hugging Face checkpoints under <cache root>/demo/ ($SPECEXEC_CACHE, else $XDG_CACHE_HOME/specexec,
else ~/.cache/specexec),
then loaded like any model and decoded greedily with the target alone and at a couple of tree budgets. The
report (rich, on stderr) shows the plan, tree size, tokens per target pass, tokens/s, and whether the output
equals the target alone.

Does not know: anything a real model would add; the text is meaningless because the weights are random.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from cli import threads
from specexec.config import EngineConfig, SamplingParams

if TYPE_CHECKING:                                  # annotations only: the command line parses without torch
    from specexec.runtime.assembly import Runtime
from specexec.checkpoints.catalog import demo_dir

TARGET_SHAPE = dict(n_layers=4, hidden=256, n_heads=4, n_kv_heads=2, intermediate=688, vocab_size=320)
DRAFT_NOISE = 0.01                 # relative weight noise: ~90% top-1 agreement with the target
PROMPT = "The quick brown fox"
BUDGETS = (8, 32)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="run a short end-to-end demo on random-weight models (nothing to download)",
                       description="Build (once, cached) a small random-weight target/draft pair and decode with it.")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens per run (default 32)")
    p.add_argument("--device", default="cpu", metavar="DEV", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", metavar="TYPE", help="float32 (default), bfloat16 or float16")
    p.add_argument("--rebuild", action="store_true", help="rebuild the cached demo models")
    return p


def cache_dir() -> Path:
    """<cache root>/demo/<version>, where `--model demo` finds it too (specexec/checkpoints/catalog.py: bump its
    DEMO_VERSION when the recipe below changes)."""
    return demo_dir()


def ensure_models(root: Path, rebuild: bool = False) -> tuple[Path, Path, bool]:
    """(target, draft, built_now). Built in a temporary sibling directory and renamed into place, so an
    interrupted build never leaves a half-written cache."""
    target, draft = root / "target", root / "draft"
    if not rebuild and (target / "config.json").is_file() and (draft / "config.json").is_file():
        return target, draft, False
    from transformers.utils import logging as hf_logging

    from specexec.checkpoints.demo_models import TOOL_CHAT_TEMPLATE, write_model, write_perturbed

    hf_logging.disable_progress_bar()
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root.parent))
    try:
        write_model(tmp / "target", seed=0, chat_template=TOOL_CHAT_TEMPLATE, **TARGET_SHAPE)
        write_perturbed(tmp / "draft", tmp / "target", DRAFT_NOISE, seed=1)
        if root.exists():
            shutil.rmtree(root)
        os.replace(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, draft, True


def _plan(console: Console, rt: Runtime) -> None:
    table = Table(title="plan", title_justify="left")
    for col in ("model", "family", "layers", "hidden", "params", "dtype", "device"):
        table.add_column(col)
    for role, info in (("target", rt.target_info), ("draft", rt.draft_info)):
        table.add_row(role, info.args.family, str(info.args.n_layers), str(info.args.dim),
                      f"{info.params / 1e6:.1f}M", info.dtype, info.device)
    console.print(table)
    console.print(f"draft = target + {DRAFT_NOISE:.0%} weight noise; checkpoints in {rt.target_info.path.parent}",
                  highlight=False)


def _runs(rt: Runtime, prompt_ids: list[int], max_new: int) -> list[tuple[str, dict, list[int], float]]:
    """(name, stats, ids, wall seconds) for target-only decoding and each budget."""
    out = []
    for budget in (None, *BUDGETS):
        config = rt.config.replace(budget=budget or rt.config.budget, max_new_tokens=max_new)
        variant = rt.variant(config, use_draft=budget is not None)
        t0 = time.perf_counter()
        ids = [t for step in variant.generate_ids(prompt_ids, max_new, SamplingParams()) for t in step]
        name = "target only" if budget is None else f"budget {budget}"
        out.append((name, variant.stats(), ids, time.perf_counter() - t0))
    return out


def _results(console: Console, runs: list[tuple[str, dict, list[int], float]]) -> bool:
    """Print the results table; return whether every run emitted the target-alone tokens."""
    table = Table(title="greedy decoding (ms are per step; tok/pass = tokens per target pass)",
                  title_justify="left")
    for col in ("run", "tree", "tok/pass", "tok/s", "draft ms", "target ms", "= target only"):
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
    baseline = runs[0][2]
    for name, stats, ids, wall in runs:
        table.add_row(name, f"{stats['tree_size']:.0f}", f"{stats['tokens_per_step']:.2f}",
                      f"{len(ids) / wall:.1f}", f"{stats['draft_ms']:.1f}", f"{stats['target_ms']:.1f}",
                      "yes" if ids == baseline else "[red]NO[/]")
    console.print(table)
    return all(ids == baseline for _, _, ids, _ in runs)


LEAD = ("What this shows: speculative decoding emits exactly the target's own tokens (the last column says so for "
        "every run), and one target pass can emit several of them (tok/pass above 1). It does not show a speed-up: "
        "these models are tiny, so a target pass costs almost nothing and drafting only adds work (expect target "
        "only to be the fastest row). The gain comes when each target pass is expensive: a large model whose "
        "weights stream from RAM or SSD.")
NOTE = ("The weights are random, so the text is meaningless; the draft is the target plus 1% noise, which is why it "
        "agrees often. On real models: specexec generate --model PATH --draft PATH --prompt TEXT")
NEXT = ("Next, with these checkpoints (`specexec models` lists them as demo and demo-draft): specexec chat --model "
        "demo, or specexec generate --model demo --prompt 'The quick brown fox'")


def run(args: argparse.Namespace) -> int:
    import torch

    before = torch.get_num_threads()
    chosen = threads.current()
    # 3M-parameter models: threads cost more than they save (and far more than that on a busy machine, where
    # OpenMP barriers wait for a core), so one unless --threads (or $OMP_NUM_THREADS) says otherwise
    torch.set_num_threads(chosen.count if chosen is not None and chosen.given else 1)
    try:
        return _demo(args, Console(stderr=True, soft_wrap=True))
    finally:
        torch.set_num_threads(before)


def _demo(args: argparse.Namespace, console: Console) -> int:
    config = EngineConfig(device=args.device, dtype=args.dtype, max_new_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    with console.status("building the demo models (first run only)..."):
        target, draft, built = ensure_models(cache_dir(), args.rebuild)
    console.print(f"{'built' if built else 'using cached'} demo models ({time.perf_counter() - t0:.1f} s)",
                  highlight=False)
    from specexec.runtime.assembly import Runtime

    rt = Runtime.load(str(target), str(draft), config)
    _plan(console, rt)
    prompt_ids = rt.encode(PROMPT)
    console.print(f"prompt {PROMPT!r} ({len(prompt_ids)} tokens), greedy, {args.max_new_tokens} new tokens",
                  highlight=False)
    runs = _runs(rt, prompt_ids, args.max_new_tokens)
    console.print(LEAD, highlight=False, markup=False)
    same = _results(console, runs)
    text = rt.tokenizer.decode(runs[0][2], skip_special_tokens=True)
    console.print(f"continuation (random weights): {text[:80]!r}", highlight=False, markup=False)
    console.print(NOTE, highlight=False, markup=False)
    if not same and config.dtype == "float32":
        console.print("error: in float32 speculative decoding must emit exactly the target-alone tokens; "
                      "it did not (a bug: please report it)", highlight=False, markup=False)
        return 1
    console.print(NEXT, highlight=False, markup=False)
    return 0
