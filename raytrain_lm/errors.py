"""The project's own error type: a problem the user can fix, reported as one line."""


class UserError(Exception):
    """Bad input or environment. The CLI prints `error: <message>` and exits with code 2."""


def last_line(error: BaseException) -> str:
    """The last non-empty line of an error's message (where Ray and torch put the cause), or
    its type when the message is empty."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
