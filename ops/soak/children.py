"""The processes the soak kills: `flywheel sink` and `flywheel learn`, each its own OS process.

A `Child` starts its command with the soak's resolved settings in the environment (one
FLYWHEEL_<SECTION> JSON value per section, the way any Flywheel process reads them), sends its
output to a log file, and is watched like a service manager would: a SIGKILL from the soak is
a fault, followed by a restart; any other exit is recorded (code, last log line) and the
process is restarted too, so the loop goes on and the check can name it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from feedback.core.config import FlywheelSettings


@dataclass(frozen=True)
class Exit:
    """An exit the soak did not cause."""

    at: float  # time.time()
    code: int
    last_line: str


def child_env(s: FlywheelSettings, sections: tuple[str, ...], **extra: str) -> dict[str, str]:
    """This process's environment without any FLYWHEEL_* of its own, plus `s`'s data and cache
    folders and the named sections as JSON (FLYWHEEL_SINK='{...}'). Only sections without secrets
    travel this way (a SecretStr would arrive masked); the database URL's password is in
    FLYWHEEL_DATABASE, readable only by this user, never on disk or on a command line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env["FLYWHEEL_DATA_DIR"] = str(s.data_dir)
    env["FLYWHEEL_CACHE_DIR"] = str(s.cache_dir)
    for name in sections:
        env[f"FLYWHEEL_{name.upper()}"] = getattr(s, name).model_dump_json()
    env["PYTHONUNBUFFERED"] = "1"
    return env | extra


class Child:
    """One `flywheel <command>` process, restarted whenever it ends."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], *, log: Path, cwd: Path):
        self.name, self.command, self.env, self.log, self.cwd = name, command, env, log, cwd
        self.proc: subprocess.Popen | None = None
        self.kills = 0  # SIGKILLs the soak sent
        self.exits: list[Exit] = []  # exits the soak did not cause
        self._lock = threading.Lock()
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        with self._lock:
            self._spawn()

    def _spawn(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ops.cli", *self.command],
                env=self.env,
                cwd=self.cwd,  # no ./flywheel.toml of the caller's is read
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def kill(self) -> int:
        """The fault: SIGKILL, then start it again at once; the pid killed."""
        with self._lock:
            assert self.proc is not None
            pid = self.proc.pid
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.kills += 1
            self._spawn()
            return pid

    def watch(self) -> Exit | None:
        """Restart it if it ended on its own; that exit, recorded, or None."""
        with self._lock:
            if self._stopping or self.proc is None or self.proc.poll() is None:
                return None
            gone = Exit(time.time(), self.proc.returncode, last_line(self.log))
            self.exits.append(gone)
            self._spawn()
            return gone

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (each command finishes what it holds and exits), SIGKILL after `timeout_s`; the exit code."""
        with self._lock:
            self._stopping = True
            if self.proc is None:
                return None
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            return self.proc.returncode


def last_line(log: Path) -> str:
    """The last non-empty line of a log file (what a process said before it ended)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""
