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
