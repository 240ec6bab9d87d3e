"""A device running behind, on the host clock: an event that completes only when the test says (a helper of
tests/offload/test_pager.py and tests/engine/test_profiler.py)."""
from __future__ import annotations

from types import SimpleNamespace

from offload.streaming.timing import HostEvent


class LagEvent(HostEvent):
    """A host-clock event that reports itself complete only once `clock.done` (a device running behind);
    synchronize() counts the waits and completes it."""

    def __init__(self, clock: SimpleNamespace) -> None:
        super().__init__()
        self.clock, self.forced = clock, False

    def query(self) -> bool:
        return self.t is not None and (self.clock.done or self.forced)

    def synchronize(self) -> None:
        self.clock.waits += 1
        self.forced = True
