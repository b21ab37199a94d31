"""The soak's child processes: a SIGKILL is the soak's own and followed by a restart; an exit it
did not cause is recorded with the process's last words and restarted too."""

from __future__ import annotations

import json
import time

from feedback.core.config import StackSettings
from ops.soak.children import Child, child_env
from tests.helpers import free_port, scaled


def test_a_child_that_ends_on_its_own_is_recorded_and_started_again(tmp_path):
    s = StackSettings(data_dir=tmp_path / "data", database={"url": "sqlite:///x.db"})
    env = child_env(s, ("kafka", "database"))
    assert json.loads(env["FLYWHEEL_DATABASE"])["url"] == "sqlite:///x.db" and env["FLYWHEEL_DATA_DIR"] == str(
        s.data_dir
    )
    # `flywheel query` with SQL it refuses: it says why on one line and exits 1.
    c = Child("query", ["query", "DELETE FROM events"], env, log=tmp_path / "query.log", cwd=tmp_path)
    c.start()
    first = c.pid
    deadline = time.monotonic() + scaled(60)
    while (gone := c.watch()) is None:
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.1)
    assert gone.code == 1 and "flywheel: error" in gone.last_line and c.pid != first
    assert c.stop(timeout_s=scaled(30)) is not None and c.watch() is None  # stopped on purpose: not an exit
    assert len(c.exits) == 1 and c.kills == 0


def test_a_sigkill_is_counted_and_followed_by_a_restart(tmp_path):
    s = StackSettings(data_dir=tmp_path / "data", kafka={"port": free_port(), "controller_port": free_port()})
    c = Child("sink", ["sink"], child_env(s, ()), log=tmp_path / "sink.log", cwd=tmp_path)
    c.start()
    first = c.pid
    assert c.kill() == first and c.pid != first and c.kills == 1
    c.stop(timeout_s=scaled(30))
    assert c.exits == []
