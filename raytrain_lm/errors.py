"""The project's own error type: a problem the user can fix, reported as one line."""


class UserError(Exception):
    """Bad input or environment. The CLI prints `error: <message>` and exits with code 2."""
