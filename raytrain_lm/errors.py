"""The project's own error types, each reported as one line: a problem the user can fix, and a
run that started but could not go on."""


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
