"""Auto mode: announced versions start rollouts, once each, one at a time."""

import time

import pytest
from sqlalchemy import func, select

from feedback import db, pools
from feedback.schemas import ModelVersion
from ops.rollout import auto, commands, rows
from ops.rollout.settings import RolloutSettings
from tests.helpers import scaled
from tests.ops.rollout.traffic import SECTION, STABLE, record_versions


def announcement(version, *, passed=True):
    return ModelVersion(
        version=version,
        kind="full",
        uri=f"file:///w/v{version}",
        sha256="0" * 64,
        gate_passed=passed,
        gate_reason=None if passed else "worse on replay",
    )


def test_auto_start_is_idempotent_and_waits_for_the_active_rollout(sqlite_engine):
    pools.set_stable(sqlite_engine, STABLE)
    outcome, r, _ = auto.start_announced(sqlite_engine, announcement(10), SECTION)
    assert outcome == "started" and r.candidate_version == 10 and r.stable_version == STABLE
    assert auto.start_announced(sqlite_engine, announcement(10), SECTION)[0] == "skipped"  # a replayed announcement
    assert auto.start_announced(sqlite_engine, announcement(11), SECTION)[0] == "waiting"
    outcome, _, why = auto.start_announced(sqlite_engine, announcement(12, passed=False), SECTION)
    assert outcome == "skipped" and "failed the gate" in why
    with sqlite_engine.connect() as conn:
        recorded = dict(
            conn.execute(
                select(db.model_versions.c.version, db.model_versions.c.gate_passed).where(
                    db.model_versions.c.version >= 10
                )
            ).all()
        )
        n_rollouts = conn.execute(select(func.count()).select_from(db.rollouts)).scalar()
    assert recorded == {10: True, 11: True, 12: False} and n_rollouts == 1
    commands.promote(sqlite_engine, by="test")
    assert auto.start_announced(sqlite_engine, announcement(11), SECTION)[0] == "started"
    assert auto.start_announced(sqlite_engine, announcement(9), SECTION)[0] == "skipped"  # older than stable


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
    record_versions(engine)
    pools.set_stable(engine, STABLE)
    import torch

    from learner import store as S

    store = S.open_store(S.default_store_uri(s))  # announced versions must be in this deployment's store
    for v in range(base, base + 3):
        store.publish(
            {"w": torch.full((4,), float(v - base), dtype=torch.bfloat16)},
            parent=v - 1 if v > base else None,
            version=v,
        )

    def announcement(version, *, passed=True):  # what the learner sends for a stored version
        return store.model_version(version, gate_passed=passed, gate_reason=None if passed else "worse on replay")

    producer = bus.producer(s.kafka)
    foreign = ModelVersion(version=base + 5, kind="full", uri="file:///elsewhere/v5", sha256="f" * 64, gate_passed=True)
    for msg in (foreign, announcement(base), announcement(base + 1, passed=False)):
        producer.send(bus.VERSIONS, key=key_of(msg), value=encode(msg))
    producer.flush()

    def drain(starter, until):
        deadline = time.monotonic() + scaled(60)
        lines = []
        while time.monotonic() < deadline and not until(lines):
            lines += starter.poll()
        return lines

    starter = auto.AutoStarter(s, engine)
    lines = drain(
        starter,
        lambda ls: any("failed the gate" in ln for ln in ls) and any(f"version {base} against" in ln for ln in ls),
    )
    starter.close()
    with engine.connect() as conn:
        assert rows.active(conn).candidate_version == base, lines
        assert conn.execute(select(db.model_versions).where(db.model_versions.c.version == base + 5)).first() is None
    assert any(f"version {base + 5} (file:///elsewhere/v5) is not in this weight store" in ln for ln in lines), lines

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
