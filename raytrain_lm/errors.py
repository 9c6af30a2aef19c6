"""The project's own error types, each reported as one line: a problem the user can fix, and a
run that started but could not go on."""

import reprlib

# A value from a file shown in a message: its start, never the whole (a string of a million
# characters, or a YAML list of lists that stands for 10^9 strings, would make the line itself
# the problem).
_brief = reprlib.Repr()
_brief.maxlevel, _brief.maxstring, _brief.maxother, _brief.maxlong = 2, 60, 60, 40
_brief.maxlist = _brief.maxdict = _brief.maxtuple = _brief.maxset = 4


class UserError(Exception):
    """Bad input or environment. The CLI prints `error: <message>` and exits with code 2."""


class RunFailed(Exception):
    """A run that started and stopped short of its end for a reason the message names (its loss
    became non-finite). The CLI prints `error: <message>` and exits with code 1."""


def last_line(error: BaseException) -> str:
    """The last non-empty line of an error's message (where Ray and torch put the cause), or
    its type when the message is empty."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def brief(value: object) -> str:
    """`repr(value)` for a message, bounded: a few items of a container, the start of a string."""
    return _brief.repr(value)
