"""How the CLI talks to a terminal: colours only where they can be seen, a progress line and a
live table redrawn in place on terminals only. (Ray's own chatter is kept out of the user's way
by cluster/connect.py's quiet_ray_logging.)"""

from __future__ import annotations

import sys
import time
from typing import IO, Optional

from raytrain_lm import env

_CODES = {"red": "31", "green": "32", "yellow": "33", "bold": "1", "dim": "2"}


def color_enabled(stream: Optional[IO] = None) -> bool:
    """Colours on a terminal only; never in pipes, files or CI logs, nor with NO_COLOR set."""
    stream = stream or sys.stdout
    if env.plain_terminal():
        return False
    return bool(getattr(stream, "isatty", lambda: False)())


def paint(text: str, color: str, stream: Optional[IO] = None) -> str:
    if not color_enabled(stream):
        return text
    return f"\033[{_CODES[color]}m{text}\033[0m"


class Progress:
    """One status line redrawn in place on a terminal (`\r`), at most twice a second; nothing in
    pipes, files or CI logs."""

    def __init__(self, enabled: bool = True, stream: Optional[IO] = None):
        self.stream = stream or sys.stdout
        self.enabled = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self._last = 0.0
        self._shown = False

    def show(self, text: str) -> None:
        if self.enabled and time.monotonic() - self._last > 0.5:
            self._last = time.monotonic()
            self.stream.write(f"\r  {text}")
            self.stream.flush()
            self._shown = True

    def done(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


class LiveTable:
    """A block of text redrawn in place on a terminal; appended (with a blank line) elsewhere."""

    def __init__(self, stream: Optional[IO] = None):
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._lines = 0

    def draw(self, text: str) -> None:
        if self.tty and self._lines:  # move up over the last drawing and clear it
            self.stream.write(f"\x1b[{self._lines}F\x1b[J")
        self.stream.write(text + ("\n" if self.tty else "\n\n"))
        self.stream.flush()
        self._lines = text.count("\n") + 1
