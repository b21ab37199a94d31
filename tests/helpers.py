"""Helpers the tests share (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from ops.config import StackSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_settings(tmp: Path, **overrides) -> StackSettings:
    """Settings isolated in `tmp`, sharing the user's download cache (Kafka jars)."""
    base = {"data_dir": str(tmp / "data")}
    if cache := os.environ.get("FLYWHEEL_CACHE_DIR"):
        base["cache_dir"] = cache
    return StackSettings(**(base | overrides))


def flywheel(*args: str, env: dict | None = None, tmp_path: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run the `flywheel` CLI as a user would, isolated in `tmp_path`."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    if tmp_path is not None:
        full_env["FLYWHEEL_DATA_DIR"] = str(tmp_path / "data")
    if "FLYWHEEL_CACHE_DIR" in os.environ:
        full_env["FLYWHEEL_CACHE_DIR"] = os.environ["FLYWHEEL_CACHE_DIR"]
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "ops.cli", *args], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=tmp_path
    )
