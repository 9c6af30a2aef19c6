"""How the CLI talks to a terminal: colours only where they can be seen, and Ray's own chatter
kept out of the user's way unless they ask for it with --verbose."""

from __future__ import annotations

import logging
import os
import sys
from typing import IO, Optional

_CODES = {"red": "31", "green": "32", "yellow": "33", "bold": "1", "dim": "2"}


def color_enabled(stream: Optional[IO] = None) -> bool:
    """Colours on a terminal only; never in pipes, files or CI logs, nor with NO_COLOR set."""
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return bool(getattr(stream, "isatty", lambda: False)())


def paint(text: str, color: str, stream: Optional[IO] = None) -> str:
    if not color_enabled(stream):
        return text
    return f"\033[{_CODES[color]}m{text}\033[0m"


class _DropMessages(logging.Filter):
    def __init__(self, *starts: str):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.starts)


_quieted = False


def quiet_ray_logging() -> None:
    """Drop Ray's driver-side notices that tell a user nothing they must act on.

    Ray 2.60 announces on every local start that token authentication is on (it is, and it is
    what we want). The opposite warning, that authentication is *off*, is a real security notice
    and stays. Worker logs are kept off the terminal separately (`log_to_driver=verbose`).
    """
    global _quieted
    if _quieted:
        return
    _quieted = True
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
        _DropMessages("Token authentication is enabled"))
