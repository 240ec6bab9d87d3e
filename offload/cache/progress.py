"""A rich progress bar on stderr for long per-layer jobs (building or verifying a layer cache).

Does not know: what the job is; the caller names it and advances the bar.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager


@contextmanager
def progress_bar(enabled: bool, total: int, what: str, unit: str = "layers", sizes: Sequence[int] | None = None,
                 done: int = 0) -> Iterator[Callable[[], None]]:
    """A bar for `total` steps (done / total, elapsed, ETA) while inside; yields advance() (one step). With
    `sizes` (bytes per step, e.g. a layer's input) the bar moves by bytes and also shows MB/s, its ETA from that
    rate; `done` steps are already done (a resumed job: they count toward the bar, not the rate). Disabled: a
    no-op."""
    if not enabled:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    if sizes is None:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                   TimeElapsedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
            task = bar.add_task(what, total=total, completed=done)
            yield lambda: bar.advance(task)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[steps]}/%d %s" % (total, unit)),
               TransferSpeedColumn(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    step = [done]
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(what, total=sum(sizes), completed=sum(sizes[:done]), steps=done)

        def advance() -> None:
            bar.update(task, advance=sizes[step[0]], steps=step[0] + 1)
            step[0] += 1

        yield advance
