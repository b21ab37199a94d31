"""The controller on a real database fed with synthetic traffic of two versions.

Every test writes rows where the sink would (completions, completion_choices, events, rewards)
and drives the controller's stateless `tick()` with an explicit clock, so that each step's window
is exact.
"""

import threading
import time
from datetime import UTC, datetime, timedelta

from feedback import db, pools
from ops.rollout import commands, controller, rows
from ops.rollout.arms import read_arm
from ops.rollout.settings import RolloutSection, RolloutSettings
from ops.rollout.stats import decide
from tests.helpers import scaled
from tests.ops.rollout.traffic import (
    CANDIDATE,
    SECTION,
    STABLE,
    T0,
    both_arms,
    record_versions,
    serve,
    start,
    steps_of,
)


def test_a_good_candidate_advances_through_every_step_and_is_promoted(engine):
    r = start(engine)
    assert (r.state, r.step_index, r.stable_version) == ("running", 0, STABLE)
    assert pools.read(engine) == pools.Routes(stable=STABLE, canary=CANDIDATE, canary_percent=5.0)

    window = T0
    for i, weight in enumerate([5, 25, 50]):
        both_arms(engine, window, weight, total=4000 if weight > 5 else 6000, canary_accept=0.42)
        assert controller.tick(engine, now=window + timedelta(seconds=30)) is None  # the step is not due yet
        now = window + timedelta(seconds=61)
        out = controller.tick(engine, now=now)
        assert out.decision.action == "advance", out.decision.reason
        assert out.rollout.step_index == i + 1
        assert pools.read(engine).canary_percent == SECTION.weights[i + 1]
        window = now
    serve(engine, CANDIDATE, 1000, start=window, accept=0.42)  # at 100% only the candidate serves
    out = controller.tick(engine, now=window + timedelta(seconds=61))
    assert out.decision.action == "promote", out.decision.reason

    with engine.connect() as conn:
        r = rows.get(conn, rollout_id=r.id)
    assert r.state == "promoted" and r.finished_at is not None
    assert pools.read(engine) == pools.Routes(stable=CANDIDATE, canary=None, canary_percent=0.0)
    history = steps_of(engine, r.id)
    assert [(s.step_index, s.weight, s.decision) for s in history] == [
        (0, 5, "advance"),
        (1, 25, "advance"),
        (2, 50, "advance"),
        (3, 100, "promote"),
    ]
    first = history[0].evidence
    assert first["arms"]["canary"]["shown"] == 300 and first["arms"]["stable"]["shown"] == 5700
    assert first["tests"]["accept_rate"]["tested"] and first["rule"] == "no_harm" and first["by"] == "controller"
    last = history[-1].evidence
    assert last["arms"]["stable"]["shown"] > 0  # at 100%: stable's traffic since before the rollout


def test_a_degraded_candidate_is_rolled_back_with_its_evidence(engine):
    r = start(engine)
    both_arms(engine, T0, 5, total=6000, canary_accept=0.20, stable_accept=0.45)
    out = controller.tick(engine, now=T0 + timedelta(seconds=61))
    assert out.decision.action == "rollback" and out.decision.rule == "accept_rate"
    assert out.rollout.state == "rolled_back" and "accept rate 20.0% vs 45.0%" in out.rollout.reason
    assert pools.read(engine) == pools.Routes(stable=STABLE, canary=None, canary_percent=0.0)
    (step,) = steps_of(engine, r.id)
    test = step.evidence["tests"]["accept_rate"]
    assert step.decision == "rollback" and step.evidence["rule"] == "accept_rate"
    assert test["n"] == [300, 5700] and test["p"] < 0.05 and test["worse"]
    assert step.evidence["policy"]["alpha"] == 0.05 and step.evidence["window"]["canary"][0].startswith(
        "2026-03-01T12:00"
    )
    assert controller.tick(engine, now=T0 + timedelta(hours=1)) is None  # finished: nothing more to decide


def test_one_user_flooding_accepts_cannot_flip_the_decision(engine):
    """A worse canary, and one editor client that posts an accept for each of its 2000 canary
    completions: counted in full, the flood turns the rollback into an advance; capped at
    rollout.max_per_user per user, the canary is still rolled back, on the same evidence it
    would have had without the flood. Pinning the version instead gets the flood no further."""
    r = start(engine, section=SECTION.model_copy(update={"max_per_user": 20}))
    both_arms(engine, T0, 5, total=6000, canary_accept=0.20, stable_accept=0.45)  # 300 canary users
    serve(engine, CANDIDATE, 2000, start=T0, accept=1.0, user="mallory")
    serve(engine, CANDIDATE, 2000, start=T0, accept=1.0, user="mallory", pinned=True)
    now = T0 + timedelta(seconds=61)

    with engine.connect() as conn:  # the evidence as it was read before the cap
        canary = read_arm(conn, version=CANDIDATE, since=T0, until=now)
        stable = read_arm(conn, version=STABLE, since=T0, until=now)
    flooded = decide(canary, stable, r.policy, holds=0, last_step=False)
    assert canary.shown == 2300 and flooded.action == "advance", flooded.reason

    out = controller.tick(engine, now=now)
    assert out.decision.action == "rollback" and out.decision.rule == "accept_rate", out.decision.reason
    arm = out.decision.evidence["arms"]["canary"]
    assert (arm["shown"], arm["accepted"], arm["capped_shown"], arm["pinned"]) == (320, 80, 1980, 2000)
    assert out.decision.evidence["policy"]["max_per_user"] == 20


def test_errors_and_latency_roll_back(sqlite_engine):
    start(sqlite_engine)
    both_arms(sqlite_engine, T0, 5, total=6000, errors=0.10)
    out = controller.tick(sqlite_engine, now=T0 + timedelta(seconds=61))
    assert out.decision.rule == "error_rate", out.decision.reason
    assert out.decision.evidence["arms"]["canary"]["errors"] == 30

    commands.start_rollout(sqlite_engine, CANDIDATE, section=SECTION, force=True, now=T0 + timedelta(hours=1))
    both_arms(sqlite_engine, T0 + timedelta(hours=1), 5, total=6000, latency_ms=400.0)
    out = controller.tick(sqlite_engine, now=T0 + timedelta(hours=1, seconds=61))
    assert out.decision.rule == "latency" and out.decision.evidence["tests"]["latency"]["ratio"] > 1.5


def test_an_under_sampled_step_holds_then_rolls_back_for_insufficient_traffic(sqlite_engine):
    r = start(sqlite_engine)
    both_arms(sqlite_engine, T0, 5, total=1000)  # 50 canary choices: half of min_samples
    out = controller.tick(sqlite_engine, now=T0 + timedelta(seconds=61))
    assert (out.decision.action, out.decision.rule) == ("hold", "min_samples")
    assert "canary 50" in out.decision.reason and out.rollout.state == "running" and out.rollout.step_index == 0
    assert (
        controller.tick(sqlite_engine, now=T0 + timedelta(seconds=90)) is None
    )  # next look: an interval after the hold
    assert controller.tick(sqlite_engine, now=T0 + timedelta(seconds=122)).decision.action == "hold"
    out = controller.tick(sqlite_engine, now=T0 + timedelta(seconds=183))
    assert (out.decision.action, out.decision.rule) == ("rollback", "insufficient_traffic")
    assert [s.decision for s in steps_of(sqlite_engine, r.id)] == ["hold", "hold", "rollback"]
    assert pools.read(sqlite_engine).canary is None


def test_holds_keep_the_window_open_so_samples_accumulate(sqlite_engine):
    start(sqlite_engine)
    both_arms(sqlite_engine, T0, 5, total=1000)
    assert controller.tick(sqlite_engine, now=T0 + timedelta(seconds=61)).decision.action == "hold"
    both_arms(sqlite_engine, T0 + timedelta(seconds=61), 5, total=2000)
    out = controller.tick(sqlite_engine, now=T0 + timedelta(seconds=122))
    assert out.decision.action == "advance" and out.decision.evidence["arms"]["canary"]["shown"] == 150


def test_a_restarted_controller_resumes_from_sql(tmp_path):
    url = f"sqlite:///{tmp_path / 'f.db'}"
    first = db.make_engine(url)
    db.upgrade(first)
    record_versions(first)
    r = start(first)
    both_arms(first, T0, 5, total=6000)
    advanced_at = T0 + timedelta(seconds=61)
    assert controller.tick(first, now=advanced_at).decision.action == "advance"
    # traffic of the next step, then the process dies (nothing of it survives but the database)
    both_arms(first, advanced_at, 25, total=2000, canary_accept=0.10, stable_accept=0.40)
    first.dispose()

    second = db.make_engine(url)
    assert controller.tick(second, now=advanced_at + timedelta(seconds=59)) is None  # the step's clock came from SQL
    out = controller.tick(second, now=advanced_at + timedelta(seconds=61))
    assert out.step_index == 1 and out.weight == 25  # it resumed at step 1 ...
    assert out.decision.action == "rollback"  # ... judging only that step's window
    assert out.decision.evidence["arms"]["canary"]["shown"] == 500
    assert out.decision.evidence["window"]["canary"][0] == advanced_at.isoformat()
    assert [s.decision for s in steps_of(second, r.id)] == ["advance", "rollback"]
    second.dispose()


def test_pools_that_disagree_with_the_rollout_are_repaired(sqlite_engine):
    r = start(sqlite_engine)
    pools.clear_canary(sqlite_engine)  # as if the write after a decision had failed, or someone meddled
    assert controller.tick(sqlite_engine, now=T0 + timedelta(seconds=1)) is None
    assert pools.read(sqlite_engine) == pools.Routes(stable=STABLE, canary=CANDIDATE, canary_percent=5.0)

    commands.abort(sqlite_engine, r.id, by="test")
    pools.set_canary(sqlite_engine, CANDIDATE, 5.0, rollout_id=r.id)  # the abort's pool write "failed"
    controller.tick(sqlite_engine)
    assert pools.read(sqlite_engine).canary is None
    pools.set_canary(sqlite_engine, 7, 10.0)  # later written by someone else (no rollout id): theirs
    controller.tick(sqlite_engine)
    assert pools.read(sqlite_engine).canary == 7


def test_run_controller_survives_a_database_that_is_not_there_yet(tmp_path, caplog):
    """Started before the database is migrated, the loop logs and retries, then drives the rollout."""
    s = RolloutSettings(data_dir=str(tmp_path / "data"), rollout={"poll_s": 0.05})
    engine = db.make_engine(s.database_url)
    stop = threading.Event()
    lines: list[str] = []
    t = threading.Thread(
        target=controller.run_controller,
        args=(s, stop),
        kwargs={"engine": engine, "progress": lines.append},
        daemon=True,
    )
    t.start()
    try:
        time.sleep(0.3)
        assert t.is_alive() and "no such table" in caplog.text
        db.upgrade(engine)
        record_versions(engine)
        pools.set_stable(engine, STABLE)
        now = datetime.now(UTC)
        r = commands.start_rollout(
            engine,
            CANDIDATE,
            section=RolloutSection(weights=[100], interval_s=0.5, min_samples=50, promote_rule="no_harm"),
            now=now,
        )
        serve(
            engine, STABLE, 200, start=now - timedelta(seconds=0.4), span_s=0.3
        )  # before the rollout: the control arm
        serve(engine, CANDIDATE, 200, start=now, span_s=0.3)
        deadline = time.monotonic() + scaled(15)
        while time.monotonic() < deadline and not any("promote" in ln for ln in lines):
            time.sleep(0.05)
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()
    assert any("recovered" in ln for ln in lines) and any(
        f"rollout {r.id}" in ln and "promote" in ln for ln in lines
    ), lines
    assert pools.read(engine).stable == CANDIDATE
    engine.dispose()


def test_a_hung_versions_consumer_stops_neither_the_rollouts_nor_the_catch_up(tmp_path, monkeypatch):
    """A Kafka client that never returns (the demo's once did): the versions thread hangs, and the
    controller still starts the recorded version from SQL."""
    from ops.rollout import auto

    hang = threading.Event()
    monkeypatch.setattr(auto.AutoStarter, "poll", lambda self: hang.wait() and [])
    s = RolloutSettings(
        data_dir=str(tmp_path / "data"), rollout={"poll_s": 0.05, "auto": True, "unannounced_after_s": 1.0}
    )
    engine = db.make_engine(s.database_url)
    db.upgrade(engine)
    record_versions(engine)  # a day old
    pools.set_stable(engine, STABLE)
    stop = threading.Event()
    lines: list[str] = []
    t = threading.Thread(
        target=controller.run_controller, args=(s, stop), kwargs={"engine": engine, "progress": lines.append}
    )
    t.start()
    try:
        deadline = time.monotonic() + scaled(30)
        while time.monotonic() < deadline and not any("without an announcement" in ln for ln in lines):
            time.sleep(0.05)
        with engine.connect() as conn:
            assert rows.active(conn).candidate_version == CANDIDATE, lines
    finally:
        stop.set()
        t.join(timeout=scaled(30))
        hang.set()
    assert not t.is_alive()  # it ends though its consumer thread was stuck
    engine.dispose()
