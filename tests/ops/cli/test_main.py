"""Each user mistake gives one clear line and a non-zero exit, never a traceback."""

import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import flywheel


def assert_one_line_error(r: subprocess.CompletedProcess, fragment: str) -> None:
    assert r.returncode != 0, r
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("flywheel: error:"), lines
    assert fragment in lines[0], lines
    assert "Traceback" not in r.stderr + r.stdout


def test_unknown_command(tmp_path):
    r = flywheel("launch-rockets", tmp_path=tmp_path)
    assert r.returncode == 2
    assert_one_line_error(r, "invalid choice")


def test_bad_config_value(tmp_path):
    assert_one_line_error(flywheel("status", "--set", "kafka.port=-5", tmp_path=tmp_path), "kafka.port")


def test_bad_config_env_value(tmp_path):
    assert_one_line_error(flywheel("status", env={"FLYWHEEL_KAFKA__PORT": "many"}, tmp_path=tmp_path), "kafka.port")


def test_unreachable_kafka(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = flywheel("up", "--set", f"kafka.bootstrap_servers=127.0.0.1:{port}", tmp_path=tmp_path)
    assert_one_line_error(r, f"127.0.0.1:{port}")


def test_port_already_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = flywheel("up", "--set", f"kafka.port={port}", tmp_path=tmp_path)
    assert_one_line_error(r, f"port {port}")


def test_java_missing(tmp_path):
    env = {"PATH": os.path.dirname(sys.executable), "JAVA_HOME": ""}  # python only, no java
    assert_one_line_error(flywheel("up", env=env, tmp_path=tmp_path), "Java not found")


def test_unreachable_database(tmp_path):
    r = flywheel("db", "upgrade", "--set", "database.url=postgresql+psycopg://x:y@127.0.0.1:1/none", tmp_path=tmp_path)
    assert_one_line_error(r, "unreachable")


@pytest.mark.parametrize("args", [["--help"], ["db", "--help"]])
def test_help_works(args, tmp_path):
    r = flywheel(*args, tmp_path=tmp_path)
    assert r.returncode == 0 and "usage" in r.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--minutes", "0"], "soak.minutes"),
        (["--set", 'soak.faults=["broker", "flood"]'], "soak.faults"),
        (["--set", "soak.faults=[]"], "soak.faults is empty"),
        (["--set", "serve.canary_replicas=0"], "serve.canary_replicas"),
    ],
)
def test_soak_refuses_what_it_cannot_run(tmp_path, args, fragment):
    """Refused before anything starts: no broker, no folder, one line."""
    assert_one_line_error(flywheel("soak", *args, tmp_path=tmp_path), fragment)
    assert not (tmp_path / "data" / "soak").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--workers", "0"], "learn.workers"),
        (["--workers", "17"], "learn.workers (17) must not exceed learn.batch_size (16)"),
        (["--set", "learn.gpu=true"], "learn.gpu applies to data-parallel workers"),
    ],
)
def test_learn_refuses_workers_it_cannot_run(tmp_path, args, fragment):
    """Refused when the settings load: no Ray, no model, one line."""
    assert_one_line_error(flywheel("learn", *args, tmp_path=tmp_path), fragment)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--updates", "0"], "--updates: '0': give a whole number of at least 1"),
        (["--versions", "-1"], "--versions: '-1'"),
        (["--train-sites", "many"], "--train-sites: 'many'"),
        (["--lr", "1e-6", "0"], "--lr: '0': give a number above 0"),
        (["--lr", "nan"], "--lr: 'nan'"),
    ],
)
def test_bench_learn_refuses_counts_below_one(tmp_path, args, fragment):
    """Refused as the arguments parse, before any model loads: one line."""
    assert_one_line_error(flywheel("bench", "learn", *args, tmp_path=tmp_path), fragment)
