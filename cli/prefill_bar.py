"""A progress bar for long prefills (chat, generate): tokens done of the prompt and tokens per second, per model,
transient on stderr, shown only when a prefill takes more than one pass or more than SHOW_AFTER_S seconds.

The engine reports progress through its `on_prefill` callback after each prefill pass (specexec.generation.
PrefillProgress: host time, it never waits for the device); this module only draws it. `prefill_bar(console,
engine)` installs the callback for one generation and takes the bar down at the first generated tokens (or
when the block ends), so the answer's text is never drawn over.

Does not know: how the engine chunks a prompt (it hears passes), models, tokens beyond their counts.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from typing import TYPE_CHECKING

if TYPE_CHECKING:                                  # annotations only: the command line parses without torch
    from specexec.decoding.engine import Engine
    from specexec.generation import PrefillProgress

SHOW_AFTER_S = 1.0


def worth_showing(p: PrefillProgress) -> bool:
    """A bar for a prefill of more than one pass, or one that has taken more than SHOW_AFTER_S so far."""
    return p.passes > 1 or p.seconds > SHOW_AFTER_S


class PrefillBar:
    """Engine.on_prefill: one task per model ("target", "draft") once worth_showing says so."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress: Progress | None = None
        self.tasks: dict[str, int] = {}
        self.stopped = False

    def __call__(self, p: PrefillProgress) -> None:
        if self.stopped or (self.progress is None and not worth_showing(p)):
            return
        if self.progress is None:
            self.progress = Progress(TextColumn("prefill {task.description}"), BarColumn(),
                                     TextColumn("{task.completed:,.0f}/{task.total:,.0f} tokens"),
                                     TextColumn("{task.fields[rate]:,.0f} tok/s"), TimeElapsedColumn(),
                                     console=self.console, transient=True)
            self.progress.start()
        if p.which not in self.tasks:
            self.tasks[p.which] = self.progress.add_task(p.which, total=p.total, rate=0.0)
        self.progress.update(self.tasks[p.which], completed=p.done, rate=p.done / max(p.seconds, 1e-9))

    def stop(self) -> None:
        """Take the bar down (idempotent); later reports are ignored."""
        self.stopped = True
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


@contextlib.contextmanager
def prefill_bar(console: Console, engine: Engine) -> Iterator[PrefillBar]:
    """Install a PrefillBar as engine.on_prefill for the block; call .stop() when the first tokens arrive."""
    bar = PrefillBar(console)
    engine.on_prefill = bar
    try:
        yield bar
    finally:
        bar.stop()
        engine.on_prefill = None
