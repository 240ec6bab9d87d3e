"""A rich progress bar on stderr for long per-layer jobs (building or verifying a layer cache).

Does not know: what the job is; the caller names it and advances the bar.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(enabled: bool, total: int, what: str, unit: str = "layers") -> Iterator[Callable[[], None]]:
    """A bar for `total` steps (done / total, elapsed, ETA) while inside; yields advance(). Disabled: a no-op."""
    if not enabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)
