"""A throwaway PostgreSQL server of the soak's own, which it can stop and start as a fault.

`initdb` in a fresh temporary folder, `pg_ctl start` on a free loopback port with a random
password (never printed, never written outside that folder), `pg_ctl stop -m immediate` for
the fault (a crash as far as the clients can tell: the server recovers from its WAL when it
starts again), and at the end stop and delete. PostgreSQL refuses to run as root, so as root
the server runs as `soak.postgres_os_user` and its folder belongs to that account.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from feedback.core.errors import UserError


def find_bin(configured: Path | None) -> Path:
    """The folder holding initdb and pg_ctl: the setting, `pg_config --bindir`, the newest
    /usr/lib/postgresql/*/bin (Debian keeps them off the PATH), or the PATH."""
    candidates: list[Path] = []
    if configured is not None:
        candidates.append(Path(configured).expanduser())
    else:
        if pg_config := shutil.which("pg_config"):
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
            if out.returncode == 0:
                candidates.append(Path(out.stdout.strip()))
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_major_version, reverse=True)
        candidates += [Path(p) for p in found]
        if initdb := shutil.which("initdb"):
            candidates.append(Path(initdb).parent)
    for c in candidates:
        if (c / "initdb").is_file() and (c / "pg_ctl").is_file():
            return c
    where = f"in {configured}" if configured is not None else "(pg_config --bindir, /usr/lib/postgresql/*/bin, PATH)"
    raise UserError(
        f"PostgreSQL's server programs (initdb, pg_ctl) are not installed {where}: install them "
        "(apt-get install postgresql), set soak.postgres_bin, or soak on SQLite (--database sqlite)"
    )


def _major_version(bin_dir: str) -> float:
    try:
        return float(Path(bin_dir).parent.name)
    except ValueError:
        return 0.0


class ThrowawayPostgres:
    """One PostgreSQL server in a temporary folder; `url` once started."""

    def __init__(self, bin_dir: Path | None, *, os_user: str, port: int):
        self.bin = find_bin(bin_dir)
        self.port = port
        self.user = os_user if os.geteuid() == 0 else None
        self.folder: Path | None = None
        self.url = ""

    @property
    def data(self) -> Path:
        assert self.folder is not None
        return self.folder / "data"

    @property
    def log(self) -> Path:
        assert self.folder is not None
        return self.folder / "postgres.log"

    def start(self) -> str:
        """initdb and start; the SQLAlchemy URL of its `postgres` database (user `flywheel`)."""
        self.folder = Path(tempfile.mkdtemp(prefix="flywheel-soak-pg-"))  # 0700
        password = secrets.token_urlsafe(24)
        pwfile = self.folder / "pw"
        pwfile.write_text(password)
        if self.user is not None:
            try:
                account = pwd.getpwnam(self.user)
            except KeyError:
                raise UserError(
                    f"running as root, the soak starts PostgreSQL as {self.user!r} (PostgreSQL refuses root), "
                    "but there is no such account: set soak.postgres_os_user"
                ) from None
            for p in (self.folder, pwfile):
                os.chown(p, account.pw_uid, account.pw_gid)
        try:
            self._run(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                "flywheel",
                "--auth=scram-sha-256",
                f"--pwfile={pwfile}",
                "-E",
                "UTF8",
                "--no-sync",  # a throwaway cluster: its files need not survive a power cut
                "--no-instructions",
            )
        finally:
            pwfile.unlink(missing_ok=True)
        self.start_server()
        self.url = f"postgresql+psycopg://flywheel:{password}@127.0.0.1:{self.port}/postgres"
        return self.url

    def start_server(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "120", "start")

    def crash(self) -> None:
        """Stop it the hard way: every connection is cut, nothing is checkpointed."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", "60", "stop")

    def restart(self, down_s: float) -> float:
        """The fault: crash, stay down `down_s`, start again (WAL recovery); the seconds start took."""
        self.crash()
        time.sleep(down_s)
        t0 = time.monotonic()
        self.start_server()
        return time.monotonic() - t0

    def close(self) -> None:
        """Stop the server (if it runs) and delete its folder."""
        if self.folder is None:
            return
        if (self.data / "postmaster.pid").exists():
            try:
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")
            except UserError:
                pass  # already down; the folder goes anyway
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None

    def _run(self, program: str, *args: str) -> None:
        # Output to a file, never a pipe: the server pg_ctl starts inherits its descriptors, and a
        # pipe held open by a daemon never reaches end-of-file.
        assert self.folder is not None
        with open(self.folder / f"{program}.out", "ab") as out:
            if self.user is not None:
                os.fchown(out.fileno(), pwd.getpwnam(self.user).pw_uid, -1)
            done = subprocess.run(
                [str(self.bin / program), *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                user=self.user,
                cwd=self.folder,
            )
        if done.returncode != 0:
            tail = (self.folder / f"{program}.out").read_text(errors="replace").strip().splitlines()[-1:] or [""]
            what = f"pg_ctl {args[-1]}" if program == "pg_ctl" else program
            raise UserError(f"PostgreSQL's {what} failed (exit {done.returncode}): {tail[0][:300]}")
