"""The one exception type that reaches a user as a single line and a non-zero exit."""


class UserError(Exception):
    """Bad input, bad config or a missing prerequisite: the message says what to do.

    The CLI prints it as `flywheel: error: <message>` and exits with `exit_code`;
    it never shows a traceback for it.
    """

    exit_code = 1

    def __init__(self, message: str, *, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def first_line(e: BaseException, *, with_type: bool = True) -> str:
    """`Type: first line of the message` (a database driver's error may run to many lines; its
    `orig` is the driver's own exception, whose message is the useful one)."""
    text = str(getattr(e, "orig", None) or e).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {line}" if with_type else line
