"""What `specexec chat` reads from the terminal: one message over several lines (a line ending in \\ continues,
\"\"\" opens and closes a block, for pastes), and the terminal's echo held while an answer streams, so what the
user types then never lands in the answer (it stays queued for the next prompt).

Does not know: what a message means (/commands, turns: cli/chat.py), line editing and history (input() and
readline do them). Where stdin is no terminal or the platform has no termios, the echo is left as it is.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TextIO


def read_message(read_line: Callable[[str], str]) -> str | None:
    """One message from the terminal: lines ending in \\ continue, \"\"\" opens and closes a block. None at
    end of input (Ctrl-D)."""
    try:
        first = read_line(">>> ")
    except EOFError:
        return None
    if first.strip() == '"""':
        return _read_block(read_line)
    lines = [first]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        try:
            lines.append(read_line("... "))
        except EOFError:
            break
    return "\n".join(lines)


def _read_block(read_line: Callable[[str], str]) -> str:
    lines: list[str] = []
    while True:
        try:
            line = read_line("... ")
        except EOFError:
            break
        if line.strip() == '"""':
            break
        lines.append(line)
    return "\n".join(lines)


def _terminal_modes(stream: TextIO) -> list | None:
    """termios' attributes of `stream`; None where it is no terminal or the platform has no termios."""
    try:
        import termios
    except ImportError:
        return None
    try:
        return termios.tcgetattr(stream.fileno())
    except (AttributeError, ValueError, OSError, termios.error):      # a test's stdin, a pipe, a file
        return None


@contextlib.contextmanager
def input_held(stream: TextIO | None = None) -> Iterator[None]:
    """While inside (an answer streaming): the terminal does not echo what the user types, so it never lands in
    the answer; it stays in the terminal's input queue (TCSANOW discards nothing, and NOFLSH keeps the Ctrl-C
    that stops an answer from flushing it) and the next prompt reads and shows it. No change where `stream` (default stdin) is not a terminal or the platform has no termios."""
    before = _terminal_modes(stream or sys.stdin)
    if before is None:
        yield
        return
    import termios

    fd = (stream or sys.stdin).fileno()
    quiet = list(before)
    quiet[3] &= ~termios.ECHO
    quiet[3] |= termios.NOFLSH        # Ctrl-C stopping the answer must not flush what was typed meanwhile
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, before)
