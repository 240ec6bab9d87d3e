"""The benchmark's progress on stderr: one bar per configuration while it runs (prompts done of all, elapsed, time
left for the whole run), a line for what happens between configurations (loading the transformers target, a
warm-up), and once the first prompt is done, one line estimating the whole run from it.

A runner reports prompts with `tell(progress, name, done, total)`; `progress` is a PromptBars or any callable of
one message (a status line: `console.status(...).update`), which then gets "NAME · prompt J/N". The time left is
the mean seconds per prompt so far times the prompts left in this run (the rest of this configuration and every
planned one not yet started), so it is known from the first finished prompt on. When stderr is not a terminal (a
log file, CI) there is no bar: one line per finished prompt instead.

Does not know: what a configuration runs, or what the table shows (cli/bench/table.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn, Task, TaskID,
                           TextColumn, TimeElapsedColumn)
from rich.text import Text


def duration(seconds: float) -> str:
    """'45 s', '12 min', '1 h 05 min'."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


class RunClock:
    """Seconds per prompt over the whole run, and what is left of it: `planned` configurations of `prompts`
    prompts each (0: unknown, only the running configurations count)."""

    def __init__(self, planned: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.planned, self.clock = planned, clock
        self.seconds, self.prompts = 0.0, 0            # finished prompts and their seconds
        self.started: dict[str, tuple[float, int]] = {}    # configuration -> (when its current prompt began, done)
        self.totals: dict[str, int] = {}
        self.finished: set[str] = set()

    def tell(self, name: str, done: int, total: int) -> None:
        now = self.clock()
        if name in self.started and done > self.started[name][1]:
            self.seconds += now - self.started[name][0]
            self.prompts += done - self.started[name][1]
        self.started[name], self.totals[name] = (now, done), total
        if done >= total:
            self.finished.add(name)

    def per_prompt(self) -> float | None:
        return self.seconds / self.prompts if self.prompts else None

    def left(self) -> float | None:
        """Seconds left in the run, from the mean so far; None before the first prompt is done."""
        each = self.per_prompt()
        if each is None:
            return None
        running = sum(t - self.started[n][1] for n, t in self.totals.items() if n not in self.finished)
        size = max(self.totals.values(), default=0)
        unstarted = max(0, self.planned - len(self.totals)) * size
        return each * (running + unstarted)

    def estimate(self) -> str:
        """The line said once the first prompt is done: the whole run from it."""
        each, size = self.per_prompt() or 0.0, max(self.totals.values(), default=0)
        configs = max(self.planned, len(self.totals))
        return (f"estimate from the first prompt ({each:.1f} s): {configs} configuration{'s' * (configs != 1)} x "
                f"{size} prompts, about {duration(each * configs * size)} in all (configurations differ in speed; "
                "--limit N runs fewer prompts)")


class LeftColumn(ProgressColumn):
    """'left 12 min' for the whole run (RunClock), '-' until the first prompt is done."""

    def __init__(self, clock: RunClock) -> None:
        super().__init__()
        self.run = clock

    def render(self, task: Task) -> Text:
        left = self.run.left()
        return Text(f"· run left {duration(left)}" if left is not None else "· run left -", style="progress.remaining")


class PromptBars:
    """A context manager; call it with a message (between configurations), or `prompts(name, done, total)`.
    `planned`: the configurations this run will go through (the time left counts the ones not started yet)."""

    def __init__(self, console: Console, planned: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.console, self.run = console, RunClock(planned, clock)
        self.live = console.is_terminal
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("prompts ·"), TimeElapsedColumn(),
                                 LeftColumn(self.run), console=console, transient=True, disable=not self.live)
        self.bars: dict[str, TaskID] = {}
        self.note = self.progress.add_task("", total=None, visible=False)
        self.said = False

    def __enter__(self) -> "PromptBars":
        self.progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.progress.stop()

    def __call__(self, message: str) -> None:
        """A step between configurations (no prompt count)."""
        self.progress.update(self.note, description=message, visible=True)
        if not self.live:
            self.console.print(message, highlight=False, markup=False)

    def prompts(self, name: str, done: int, total: int) -> None:
        """Configuration `name` has run `done` of its `total` prompts; its bar goes once all are done."""
        self.run.tell(name, done, total)
        if self.run.prompts and not self.said:
            self.said = True
            self.console.print(self.run.estimate(), highlight=False, markup=False, style="dim")
        elif done and not self.live:
            left = self.run.left()
            self.console.print(f"{name} · prompt {done}/{total} · {self.run.per_prompt():.1f} s per prompt"
                               + (f" · run left {duration(left)}" if left is not None else ""),
                               highlight=False, markup=False)
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
