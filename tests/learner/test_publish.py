"""The one publish path: store, then the model_versions row, then the announcement; a version
already stored is recorded and announced without storing it again."""

from __future__ import annotations

import logging

import pytest

from feedback import bus, db
from learner import store as S
from learner.publish import publish_version
from tests.learner.test_store import chain  # noqa: F401  (the fixture)
from tests.learner.train.learn_support import ListProducer


class SlowProducer(ListProducer):
    def flush(self, timeout_s=30.0):
        return False  # Kafka unreachable: the message stays buffered


def rows(engine) -> list[dict]:
    with engine.connect() as conn:
        return [
            dict(r) for r in conn.execute(db.model_versions.select().order_by(db.model_versions.c.version)).mappings()
        ]


def test_publish_stores_then_records_then_announces(tmp_path, chain):  # noqa: F811
    ckpts, _, _ = chain
    store = S.open_store(tmp_path / "w")
    engine = db.make_engine(f"sqlite:///{tmp_path / 'f.db'}")
    db.upgrade(engine)
    producer = ListProducer()
    seen: list[str] = []

    def announced(topic, msg):
        # By the time anyone hears of a version, it is in the store and in SQL.
        assert msg.version in store.versions() and [r["version"] for r in rows(engine)][-1] == msg.version
        seen.append(topic)
        return True

    producer.send = announced
    m0 = publish_version(store, ckpts[0], parent=None, engine=engine, producer=producer, gate_passed=True)
    m1 = publish_version(
        store,
        ckpts[1],
        parent=0,
        engine=engine,
        producer=producer,
        gate_passed=False,
        gate_reason="kl: spike",
        metrics={"kl": 0.3},
    )
    assert (m0.version, m0.kind, m1.version, m1.kind, m1.parent) == (0, "full", 1, "delta", 0)
    assert seen == [bus.VERSIONS, bus.VERSIONS]
    r = rows(engine)
    assert [(x["version"], x["gate_passed"], x["gate_reason"], x["metrics"]) for x in r] == [
        (0, True, None, {}),
        (1, False, "kl: spike", {"kl": 0.3}),
    ]
    assert r[1]["sha256"] == m1.sha256 == store.model_version(1).sha256


def test_a_stored_version_is_recorded_and_announced_without_storing_it_again(tmp_path, chain, caplog):  # noqa: F811
    ckpts, _, _ = chain
    store = S.open_store(tmp_path / "w")
    store.publish(ckpts[0], parent=None)  # the publisher stopped before recording it
    engine = db.make_engine(f"sqlite:///{tmp_path / 'f.db'}")
    db.upgrade(engine)
    producer = SlowProducer()
    with caplog.at_level(logging.WARNING, logger="learner.publish"):
        msg = publish_version(
            store, None, parent=None, version=0, engine=engine, producer=producer, gate_passed=True, gate_reason="base"
        )
    assert store.versions() == [0] and msg.version == 0 and msg.gate_reason == "base"
    assert [(t, m.version) for t, m in producer.sent] == [(bus.VERSIONS, 0)] and rows(engine)[0][
        "gate_reason"
    ] == "base"
    assert "not yet on flywheel.versions" in caplog.text  # recorded; the announcement waits in the buffer
    with pytest.raises(ValueError, match="version 3 is not in the store"):
        publish_version(store, None, parent=None, version=3, engine=engine, producer=producer, gate_passed=True)
