"""A CUDAGraph that, during every capture, makes the calls the pager's reader thread makes from another thread
(record an event on a stream, wait on it), and counts captures and replays. Under a global-mode capture those
calls are illegal (CUDA refuses them and invalidates the capture: graphs switch off); under a thread-local one
they are fine. Used by the gpu tests (tests/builders/test_draft_graphs.py) and tools/gpu-check's graphs-ssd step.

Does not know: specexec (it only swaps torch.cuda.CUDAGraph while active).
"""
from __future__ import annotations

import threading

import torch


class ReaderDuringCapture:
    """`with ReaderDuringCapture(stream) as w:` swaps torch.cuda.CUDAGraph; then w.captures, w.replays, w.errors
    (what the other thread's calls raised)."""

    def __init__(self, stream: "torch.cuda.Stream | None" = None) -> None:
        self.stream, self.captures, self.replays, self.errors = stream, 0, 0, []
        self._real = None

    def __enter__(self) -> "ReaderDuringCapture":
        self._real = torch.cuda.CUDAGraph
        torch.cuda.CUDAGraph = self._watched(self._real)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.CUDAGraph = self._real

    def _watched(self, base: type) -> type:
        watch = self

        class Watched(base):
            def capture_begin(self, *args, **kwargs):
                super().capture_begin(*args, **kwargs)
                watch.captures += 1
                t = threading.Thread(target=watch.reader)
                t.start()
                t.join()

            def replay(self):
                watch.replays += 1
                return super().replay()
        return Watched

    def reader(self) -> None:
        try:
            stream = self.stream or torch.cuda.Stream()
            ev = torch.cuda.Event()
            ev.record(stream)
            ev.synchronize()
        except Exception as e:                          # noqa: BLE001 -- what a reader thread would hit
            self.errors.append(f"{type(e).__name__}: {e}"[:200])
