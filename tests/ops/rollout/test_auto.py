"""Auto mode: announced versions start rollouts, once each, one at a time, and only the versions
this deployment's learner recorded (model_versions decides, not the announcement)."""

import time

import pytest
from sqlalchemy import func, select

from feedback import db, pools
from feedback.core.clock import utcnow
from feedback.schemas import ModelVersion
from ops.rollout import auto, commands, rows
from ops.rollout.settings import RolloutSettings
from tests.helpers import scaled
from tests.ops.rollout.traffic import CANDIDATE, SECTION, STABLE, record_versions, sha256_of


def announcement(version, *, sha256=None, uri=None):
    """An announcement on flywheel.versions. It claims the gate passed: only the version's row in
    model_versions may say whether it did."""
    return ModelVersion(
        version=version,
        kind="full",
        uri=uri or f"file:///w/v{version}",
        sha256=sha256 or sha256_of(version),
        gate_passed=True,
    )


def model_versions(engine) -> list[tuple]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(db.model_versions).order_by(db.model_versions.c.version))]


def n_rollouts(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(db.rollouts)).scalar()


def test_auto_start_is_idempotent_and_waits_for_the_active_rollout(sqlite_engine):
    record_versions(sqlite_engine, [(9, True), (10, True), (11, True), (12, False)])
    recorded = model_versions(sqlite_engine)
    pools.set_stable(sqlite_engine, STABLE)
    outcome, r, _ = auto.start_announced(sqlite_engine, announcement(10), SECTION)
    assert outcome == "started" and r.candidate_version == 10 and r.stable_version == STABLE
    assert auto.start_announced(sqlite_engine, announcement(10), SECTION)[0] == "skipped"  # a replayed announcement
    assert auto.start_announced(sqlite_engine, announcement(11), SECTION)[0] == "waiting"
    outcome, _, why = auto.start_announced(sqlite_engine, announcement(12), SECTION)
    assert outcome == "skipped" and "failed the gate (reward hacking suspected)" in why  # the learner's record says so
    assert model_versions(sqlite_engine) == recorded and n_rollouts(sqlite_engine) == 1  # auto mode writes no version
    commands.promote(sqlite_engine, by="test")
    assert auto.start_announced(sqlite_engine, announcement(11), SECTION)[0] == "started"
    outcome, _, why = auto.start_announced(sqlite_engine, announcement(9), SECTION)
    assert outcome == "skipped" and "not newer than stable v10" in why


def test_a_version_this_deployment_did_not_record_is_never_rolled_out(sqlite_engine):
    """A topic shared with another deployment: its announcements name versions this deployment's
    learner never recorded, or another version under a number this one has (another sha256)."""
    recorded = model_versions(sqlite_engine)
    pools.set_stable(sqlite_engine, STABLE)
    outcome, _, why = auto.start_announced(sqlite_engine, announcement(50, uri="file:///elsewhere/v50"), SECTION)
    assert outcome == "skipped" and why.startswith(
        "version 50 (file:///elsewhere/v50) is not in this deployment's model_versions"
    )
    foreign = announcement(CANDIDATE, sha256="f" * 64, uri="file:///elsewhere/v2")
    outcome, _, why = auto.start_announced(sqlite_engine, foreign, SECTION)
    assert outcome == "skipped" and why.startswith(
        f"version {CANDIDATE} (file:///elsewhere/v2) is not the one in this deployment's model_versions"
    )
    assert model_versions(sqlite_engine) == recorded and n_rollouts(sqlite_engine) == 0
    assert auto.start_announced(sqlite_engine, announcement(CANDIDATE), SECTION)[0] == "started"


@pytest.mark.slow
@pytest.mark.kafka
def test_auto_mode_consumes_flywheel_versions(kafka_settings, tmp_path):
    from feedback import bus
    from feedback.schemas import encode, key_of

    base = 10_000_000 + int(time.time()) % 1_000_000  # newer than anything other tests announce on the shared topic
    s = RolloutSettings(
        data_dir=str(tmp_path / "data"),
        kafka=kafka_settings.kafka.model_dump(),
        rollout={"auto": True, "group_id": f"rollout-test-{base}"},
    )
    engine = db.make_engine(s.database_url)
    db.upgrade(engine)
    record_versions(engine, [(base, True), (base + 1, False), (base + 2, True)])  # what the learner recorded
    recorded = model_versions(engine)
    pools.set_stable(engine, STABLE)

    producer = bus.producer(s.kafka)
    # Another deployment on the same topic: a version this one never recorded, and its own
    # version under a number this one has.
    foreign = [
        announcement(base + 5, sha256="f" * 64, uri="file:///elsewhere/v5"),
        announcement(base + 2, sha256="e" * 64, uri="file:///elsewhere/v2"),
    ]
    for msg in (*foreign, announcement(base), announcement(base + 1)):
        producer.send(bus.VERSIONS, key=key_of(msg), value=encode(msg))
    producer.flush()

    def drain(starter, until):
        deadline = time.monotonic() + scaled(60)
        lines = []
        while time.monotonic() < deadline and not until(lines):
            lines += starter.poll()
        return lines

    expected = (
        "failed the gate",
        f"version {base} against",
        f"version {base + 5} (file:///elsewhere/v5) is not in this deployment's model_versions",
        f"version {base + 2} (file:///elsewhere/v2) is not the one in this deployment's model_versions",
    )
    starter = auto.AutoStarter(s, engine)
    lines = drain(starter, lambda ls: all(any(e in ln for ln in ls) for e in expected))
    starter.close()
    for e in expected:
        assert any(e in ln for ln in lines), (e, lines)
    with engine.connect() as conn:
        assert rows.active(conn).candidate_version == base, lines
    assert model_versions(engine) == recorded  # the announcements wrote nothing

    producer.send(bus.VERSIONS, key=key_of(announcement(base + 2)), value=encode(announcement(base + 2)))
    producer.flush()
    restarted = auto.AutoStarter(s, engine)  # resumes after the committed offsets: base is not replayed
    drain(restarted, lambda ls: restarted.pending is not None and restarted.pending.version == base + 2)
    assert auto.start_announced(engine, announcement(base + 2), s.rollout)[0] == "waiting"  # base's rollout still runs
    commands.abort(engine, by="test")
    lines = drain(restarted, lambda ls: any("against" in ln for ln in ls))
    restarted.close()
    producer.close()
    with engine.connect() as conn:
        versions = [
            row.candidate_version
            for row in conn.execute(select(db.rollouts.c.candidate_version).order_by(db.rollouts.c.id))
        ]
    assert versions == [base, base + 2], lines
    engine.dispose()


def test_a_recorded_version_whose_announcement_was_lost_is_rolled_out_after_the_wait(sqlite_engine, tmp_path):
    """No broker at all: catch_up reads model_versions and takes the newest version above stable
    once it has waited rollout.unannounced_after_s."""
    s = RolloutSettings(data_dir=str(tmp_path / "data"), rollout=SECTION.model_dump() | {"auto": True})
    pools.set_stable(sqlite_engine, STABLE)
    with sqlite_engine.begin() as conn:  # the learner records v4 now; its announcement may still come
        conn.execute(
            db.model_versions.insert().values(
                version=4,
                parent=None,
                kind="full",
                uri="file:///w/v4",
                sha256=sha256_of(4),
                size_bytes=1,
                full_size_bytes=1,
                gate_passed=True,
                metrics={},
                created_at=utcnow(),
            )
        )
    starter = auto.AutoStarter(s, sqlite_engine)
    assert starter.catch_up() == [] and n_rollouts(sqlite_engine) == 0  # v4 is newest, and too recent: it waits
    # (v2, a day old, is not taken meanwhile: v4's announcement, when it comes, supersedes it)

    s.rollout.unannounced_after_s = 1e-3
    (line,) = starter.catch_up()
    assert f"version 4 against v{STABLE}" in line and "without an announcement" in line
    with sqlite_engine.connect() as conn:
        assert rows.active(conn).candidate_version == 4
    assert starter.catch_up() == [] and n_rollouts(sqlite_engine) == 1  # once

    commands.abort(sqlite_engine, by="test")
    assert starter.catch_up() == []  # nothing newer than v4's rollout: v2 is never taken up
    assert n_rollouts(sqlite_engine) == 1


def test_a_version_that_failed_the_gate_is_never_caught_up(sqlite_engine, tmp_path):
    s = RolloutSettings(data_dir=str(tmp_path / "data"), rollout=SECTION.model_dump() | {"auto": True})
    pools.set_stable(sqlite_engine, CANDIDATE)  # v3 (GATE_FAILED) is the only version above stable
    starter = auto.AutoStarter(s, sqlite_engine)
    assert starter.catch_up() == [] and n_rollouts(sqlite_engine) == 0


def test_an_announcement_being_acted_on_comes_first(sqlite_engine, tmp_path):
    s = RolloutSettings(data_dir=str(tmp_path / "data"), rollout=SECTION.model_dump() | {"auto": True})
    pools.set_stable(sqlite_engine, STABLE)
    starter = auto.AutoStarter(s, sqlite_engine)
    starter.pending = announcement(CANDIDATE)
    s.rollout.unannounced_after_s = 1e-3
    assert starter.catch_up() == [] and n_rollouts(sqlite_engine) == 0


def test_stable_v0_is_not_caught_up_as_a_candidate(tmp_path):
    engine = db.make_engine(f"sqlite:///{tmp_path / 'f.db'}")
    db.upgrade(engine)
    record_versions(engine, [(0, True)])
    pools.set_stable(engine, 0)
    s = RolloutSettings(data_dir=str(tmp_path / "data"), rollout=SECTION.model_dump() | {"auto": True})
    s.rollout.unannounced_after_s = 1e-3
    assert auto.AutoStarter(s, engine).catch_up() == [] and n_rollouts(engine) == 0  # nothing said either
    engine.dispose()
