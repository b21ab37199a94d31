"""The one exception type that reaches a user as a single line and a non-zero exit.

Every message shown to a user passes `mask_secrets`: a database URL's password (also in a URL
too malformed to parse) and a libpq `password=` option become `***`, so an error line, a log
line or a CI transcript never carries one.
"""

import re

# scheme://user:PASSWORD@ (the user may be empty); the password runs to the last @ before a
# space or quote, as a URL parser would read it.
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@'\"]*:)(?P<password>[^\s'\"]*)@")
_KEYWORD_PASSWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?P<password>'(?:[^'\\]|\\.)*'|[^\s'\"]+)", re.I)


def mask_secrets(text: str) -> str:
    """`text` with URL passwords and `password=...` options replaced by ***."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}***@", text)
    return _KEYWORD_PASSWORD.sub(lambda m: f"{m['head']}***", text)


class UserError(Exception):
    """Bad input, bad config or a missing prerequisite: the message says what to do.

    The CLI prints it as `flywheel: error: <message>` and exits with `exit_code`;
    it never shows a traceback for it.
    """

    exit_code = 1

    def __init__(self, message: str, *, exit_code: int = 1):
        super().__init__(mask_secrets(message))
        self.exit_code = exit_code


def first_line(e: BaseException, *, with_type: bool = True) -> str:
    """`Type: first line of the message` (a database driver's error may run to many lines; its
    `orig` is the driver's own exception, whose message is the useful one)."""
    text = str(getattr(e, "orig", None) or e).strip()
    line = mask_secrets(text.splitlines()[0]) if text else ""
    return f"{type(e).__name__}: {line}" if with_type else line
