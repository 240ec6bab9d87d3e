"""Bringing --model / --draft onto this machine before a command loads them.

A Hub id (`ORG/NAME`) or a models.yaml name that is not cached is downloaded by specexec.checkpoints.hub
(config, tokenizer, safetensors; resumable) with a progress bar on stderr (bytes, speed, ETA), after a
free-disk check that also counts the layer cache the offload plan will build for the target (the caller passes
it: cli/args.py target_reserve, from specexec.planning.disk_need). `--offline` (or HF_HUB_OFFLINE=1) only looks
in the cache; `--gguf-file NAME` picks the file of a GGUF repo. Existing paths are
left alone. On Ctrl-C during a download one line says that the next run resumes it.

Does not know: which files a checkpoint needs or how they are fetched (specexec.checkpoints.hub), the planner,
the command flags (cli/args.py imports this module, never the other way).
"""
from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from specexec.checkpoints.hub import HubOptions, Progress, Reserve


def add_hub_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--offline", action="store_true", help="never download: use only models already on this machine "
                   "(also HF_HUB_OFFLINE=1)")
    p.add_argument("--gguf-file", metavar="NAME", help="the .gguf file to fetch when --model names a GGUF repo")


def is_remote_name(spec: str | None) -> bool:
    """A --model/--draft value that is not a path on this machine but a Hub id or a models.yaml name."""
    from specexec.checkpoints.catalog import find
    from specexec.checkpoints.loading import HUB_ID

    if not spec or Path(spec).expanduser().exists():
        return False
    return find(spec) is not None or bool(HUB_ID.match(spec) and not spec.startswith((".", "/")))


def fetch_model(args: argparse.Namespace, attr: str, reserve: Reserve | None = None) -> None:
    """args.<attr> (model or draft) -> the local checkpoint path, downloading it when needed."""
    from specexec.checkpoints.loading import resolve_model_path
    from specexec.drafters.registry import parse_draft

    spec = getattr(args, attr, None)
    parsed = parse_draft(spec) if attr == "draft" else None
    drafter = parsed.drafter if parsed is not None else None
    if drafter is not None and drafter.written != "PATH":     # KIND:ORG/NAME: fetch the head, keep its kind
        where = parsed.where
        if is_remote_name(where):
            with download_bar(Console(stderr=True, soft_wrap=True), where) as progress:
                opts = HubOptions(offline=bool(getattr(args, "offline", False)), progress=progress, model=False)
                setattr(args, attr, f"{drafter.name}:{resolve_model_path(where, opts)}")
        return
    if not is_remote_name(spec):
        return
    gguf = getattr(args, "gguf_file", None) if attr == "model" else None
    console = Console(stderr=True, soft_wrap=True)
    with download_bar(console, spec) as progress:
        opts = HubOptions(offline=bool(getattr(args, "offline", False)), gguf_file=gguf, progress=progress,
                          reserve=reserve)
        setattr(args, attr, str(resolve_model_path(spec, opts)))


@contextmanager
def download_bar(console: Console, what: str) -> Iterator[Progress]:
    """A Progress callback that shows a rich bar (size, speed, ETA) from its first call on."""
    from rich.progress import (BarColumn, DownloadColumn, Progress as Bar, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    state: dict = {}

    def progress(done: int, total: int, name: str) -> None:
        if "bar" not in state:
            bar = Bar(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False)
            bar.start()
            state["bar"], state["task"] = bar, bar.add_task(f"downloading {what}", total=max(total, 1))
        state["done"], state["total"] = done, total
        state["bar"].update(state["task"], completed=done, total=max(total, 1),
                            description=f"downloading {what} ({name})")

    try:
        yield progress
        if "bar" in state:
            state["bar"].update(state["task"], description=f"downloaded {what}")
    except KeyboardInterrupt:
        if "bar" in state:
            state["bar"].stop()
            console.print(f"download interrupted at {state['done'] / 1e6:.1f} of {state['total'] / 1e6:.1f} MB; "
                          "run the same command again to resume it", style="yellow", highlight=False)
            state.pop("bar")
        raise
    finally:
        if "bar" in state:
            state["bar"].stop()
