"""The benchmark's progress on stderr: one bar per configuration while it runs (prompts done of all, elapsed, time
left), and a line for what happens between configurations (loading the transformers target, a warm-up).

A runner reports prompts with `tell(progress, name, done, total)`; `progress` is a PromptBars or any callable of
one message (a status line: `console.status(...).update`), which then gets "NAME · prompt J/N".

Does not know: what a configuration runs, or what the table shows (cli/bench/table.py).
"""
from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TaskID, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)


class PromptBars:
    """A context manager; call it with a message (between configurations), or `prompts(name, done, total)`."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("prompts ·"), TimeElapsedColumn(),
                                 TextColumn("· left"), TimeRemainingColumn(), console=console, transient=True)
        self.bars: dict[str, TaskID] = {}
        self.note = self.progress.add_task("", total=None, visible=False)

    def __enter__(self) -> "PromptBars":
        self.progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.progress.stop()

    def __call__(self, message: str) -> None:
        """A step between configurations (no prompt count)."""
        self.progress.update(self.note, description=message, visible=True)

    def prompts(self, name: str, done: int, total: int) -> None:
        """Configuration `name` has run `done` of its `total` prompts; its bar goes once all are done."""
        self.progress.update(self.note, visible=False)
        if name not in self.bars:
            self.bars[name] = self.progress.add_task(name, total=total)
        self.progress.update(self.bars[name], completed=done)
        if done >= total:
            self.progress.remove_task(self.bars.pop(name))


def tell(progress: Callable[[str], None], name: str, done: int, total: int) -> None:
    """Report `done` of `total` prompts of configuration `name` to a PromptBars, or as a status line."""
    prompts = getattr(progress, "prompts", None)
    if prompts is not None:
        prompts(name, done, total)
    elif done < total:
        progress(f"{name} · prompt {done + 1}/{total}")
