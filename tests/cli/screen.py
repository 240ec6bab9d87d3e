"""What a chat session shows, captured: the answer text (write) and everything else (console) (a helper of
tests/cli/test_chat.py and the reliability tests)."""
from __future__ import annotations

import io

from rich.console import Console


class Screen:
    """What a session shows: answer text (write) and everything else (console)."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.err = io.StringIO()
        self.console = Console(file=self.err, width=200, no_color=True)

    def write(self, text: str) -> None:
        self.out.append(text)

    @property
    def answer_text(self) -> str:
        return "".join(self.out)
