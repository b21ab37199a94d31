"""`flywheel rollout ...` run as a user would, on a database with the rollout tests' versions."""

import json

from feedback import db, pools
from tests.helpers import flywheel
from tests.ops.rollout.traffic import CANDIDATE, GATE_FAILED, STABLE, record_versions


def test_cli(tmp_path):
    engine = db.make_engine(f"sqlite:///{tmp_path / 'data' / 'flywheel.db'}")
    db.upgrade(engine)
    record_versions(engine)
    pools.set_stable(engine, STABLE)
    engine.dispose()

    r = flywheel("rollout", "start", "42", tmp_path=tmp_path)
    assert (
        r.returncode == 1
        and r.stderr.strip().startswith("flywheel: error: unknown version 42")
        and len(r.stderr.strip().splitlines()) == 1
    )
    r = flywheel(
        "rollout",
        "start",
        str(CANDIDATE),
        "--weights",
        "10,50,100",
        "--interval",
        "2m",
        "--threshold",
        "reward_drop=0.1",
        "--threshold",
        "accept_rate_loss=0.02",
        "--promote-rule",
        "expected_loss",
        tmp_path=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "canary at 10%" in r.stdout and "120s each" in r.stdout
    r = flywheel("rollout", "start", str(GATE_FAILED), tmp_path=tmp_path)
    assert r.returncode == 1 and "failed the learner's evaluation gate" in r.stderr
    r = flywheel("rollout", "start", str(GATE_FAILED), "--force", tmp_path=tmp_path)
    assert r.returncode == 1 and "is running" in r.stderr
    assert flywheel("rollout", "pause", tmp_path=tmp_path).returncode == 0
    r = flywheel("rollout", "status", "--json", tmp_path=tmp_path)
    st = json.loads(r.stdout)
    assert (
        st["rollout"]["state"] == "paused"
        and st["rollout"]["interval_s"] == 120
        and st["rollout"]["thresholds"]["reward_drop"] == 0.1
        and st["rollout"]["thresholds"]["accept_rate_loss"] == 0.02
        and st["rollout"]["thresholds"]["promote_rule"] == "expected_loss"
    )
    assert st["steps"][0]["evidence"]["by"].startswith("cli")
    r = flywheel("rollout", "abort", "--reason", "not today", tmp_path=tmp_path)
    assert r.returncode == 0 and "aborted" in r.stdout
    r = flywheel("rollout", "start", "2", "--interval", "soon", tmp_path=tmp_path)
    assert r.returncode == 1 and "bad duration" in r.stderr
