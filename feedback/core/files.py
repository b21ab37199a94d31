"""Folders and files only their owner can open: Flywheel's state holds user data and secrets.

The data folder, the SQLite database, the weight store and the learner's state are created
owner-only (folders 0700, files 0600) whatever the process's umask: a shared machine's other
users must not read completions, prompts or the key behind `user_hash`. Only what Flywheel
creates is set; a folder or file that exists already keeps its mode (the operator chose it).
The modes are set with chmod after creating, because the umask can only remove bits from the
mode `mkdir` and `open` are given (a umask of 0277 would leave a file its owner cannot write).
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def private_dir(path: str | Path) -> Path:
    """`path` as a folder, created with any missing parents owner-only; returns it."""
    path = Path(path).expanduser()
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            p.mkdir(mode=PRIVATE_DIR)
        except FileExistsError:  # another process made it meanwhile: its mode is its own
            continue
        os.chmod(p, PRIVATE_DIR)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a folder")
    return path


def private_file(path: str | Path) -> bool:
    """Create `path` empty and owner-only unless it exists (True if it was created)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
    except FileExistsError:
        return False
    try:
        os.fchmod(fd, PRIVATE_FILE)
    finally:
        os.close(fd)
    return True


def open_private(path: str | Path):
    """`open(path, "wb")` for a file that is created (or truncated) owner-only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    try:
        if os.fstat(fd).st_uid == os.getuid():  # only the owner may chmod; another's file keeps its mode
            os.fchmod(fd, PRIVATE_FILE)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise
