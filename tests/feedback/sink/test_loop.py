"""The sink against a real Kafka broker and real databases (issue 5, acceptance 1-3).

Each test uses its own topics and consumer group, so tests sharing the session broker
never see each other's messages.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import select

from feedback import db
from tests.feedback.sink.sink_support import (
    completion,
    count,
    events_for,
    private_topics,
    produce,
    running_sink,
    sink_settings,
    wait_until,
)
from tests.helpers import scaled

pytestmark = [pytest.mark.slow, pytest.mark.kafka]

# Event patterns per completion and the reward each must earn (hand-computed; TEXT = "hello world").
PATTERNS = [
    (("view", "select"), 0.75),
    (("view", "dismiss"), -0.25),
    (("view",), -0.25),
    (("view", "select", "edit"), 0.75 * 14 / 22),  # kept "hello there": 2*7/22 similar
    (("view", "word"), 0.75 * 5 / 11),  # accepted "hello" of "hello world"
    ((), 0.0),  # never shown
]


def _dead(reason: str) -> float:
    return REGISTRY.get_sample_value("flywheel_sink_dead_letters_total", {"reason": reason}) or 0.0


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'sink.db'}"
    return request.getfixturevalue("postgres_url")


def test_exactly_once_with_duplicates_retries_and_out_of_order(kafka_settings, database_url):
    run = uuid.uuid4().hex[:6]
    n = 24
    comps = [completion(f"{run}-c{i}", "" if i % 8 == 7 else "hello world") for i in range(n)]
    events = {
        c.completion_id: events_for(c.completion_id, *PATTERNS[i % len(PATTERNS)][0]) for i, c in enumerate(comps)
    }
    early = {c.completion_id for c in comps[18:]}  # their events are sent before their completions
    ghosts = [e for i in range(3) for e in events_for(f"{run}-ghost{i}", "view")]
    junk = [b"{not json", b'{"completion_id": "x", "type": "teleport"}', b"\xff\xfe"]
    all_events = [e for evs in events.values() for e in evs]

    with private_topics(kafka_settings) as (c_topic, e_topic):
        # The grace period must outlast the test's own steps on a loaded machine (the early events
        # are held from the sink's first batch until their completions arrive), and is waited out
        # once: the ghosts' events become dead letters only when it ends.
        grace_s = scaled(20)
        settings = sink_settings(
            kafka_settings, database_url, (c_topic, e_topic), feedback_window_s=2, grace_period_s=grace_s
        )
        engine = db.make_engine(database_url)
        db.upgrade(engine)
        before = {r: _dead(r) for r in ("malformed", "unknown_completion")}
        produce(kafka_settings, [(e_topic, e) for cid in sorted(early) for e in events[cid]])
        produce(
            kafka_settings,
            [(e_topic, e) for e in ghosts] + [(e_topic, junk[0]), (e_topic, junk[1]), (c_topic, junk[2])],
        )
        with running_sink(settings) as result:
            n_early = sum(len(events[cid]) for cid in early)
            wait_until(lambda: count(engine, "pending_events") == n_early + len(ghosts), 30, "early events held")
            retries = all_events[::3]  # the same event_id sent again, as a client retry would
            produce(kafka_settings, [(c_topic, c) for c in comps] + [(c_topic, c) for c in comps[:4]])
            produce(kafka_settings, [(e_topic, e) for cid, evs in events.items() if cid not in early for e in evs])
            produce(kafka_settings, [(e_topic, e) for e in retries])

            def settled():
                return (
                    count(engine, "events") == len(all_events)
                    and count(engine, "pending_events") == 0
                    and count(engine, "dead_letters") == 6
                    and count(engine, "reward_due") == 0
                    and count(engine, "rewards") == n
                )

            wait_until(settled, 60 + 20, "every row stored, held events resolved, rewards computed")  # + the grace

        with engine.connect() as conn:
            assert {r.completion_id for r in conn.execute(select(db.completions.c.completion_id))} == {
                c.completion_id for c in comps
            }
            assert count(engine, "completion_choices") == n
            assert sorted(conn.execute(select(db.events.c.event_id)).scalars()) == sorted(
                str(e.event_id) for e in all_events
            )
            dead = conn.execute(select(db.dead_letters).order_by(db.dead_letters.c.id)).all()
            rewards = {r.completion_id: r for r in conn.execute(select(db.rewards))}
        assert sorted(d.reason for d in dead) == ["malformed"] * 3 + ["unknown_completion"] * 3
        assert {d.event_id for d in dead if d.reason == "unknown_completion"} == {str(e.event_id) for e in ghosts}
        assert {bytes(d.payload) for d in dead if d.reason == "malformed"} == set(junk)
        assert all(d.kafka_topic in (c_topic, e_topic) and d.kafka_offset >= 0 and d.error for d in dead)
        for i, c in enumerate(comps):
            expected = 0.0 if i % 8 == 7 else PATTERNS[i % len(PATTERNS)][1]
            assert rewards[c.completion_id].reward == pytest.approx(expected), (i, rewards[c.completion_id].components)
            assert rewards[c.completion_id].model_version == 1
        assert result.stats.counts.dead_letters == {"malformed": 3, "unknown_completion": 3}
        assert {r: _dead(r) - before[r] for r in before} == {"malformed": 3, "unknown_completion": 3}
        engine.dispose()


def _sink_cli(settings, log) -> subprocess.Popen:
    s = settings.sink
    sets = {
        "data_dir": str(settings.data_dir),
        "kafka.bootstrap_servers": settings.kafka.bootstrap,
        "database.url": settings.database.url,
        "sink.group_id": s.group_id,
        "sink.completions_topic": s.completions_topic,
        "sink.events_topic": s.events_topic,
        "sink.batch_size": s.batch_size,
        "sink.max_batch_wait_s": s.max_batch_wait_s,
        "sink.session_timeout_ms": s.session_timeout_ms,
        "sink.progress_interval_s": 1,
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    return subprocess.Popen(
        [sys.executable, "-m", "ops.cli", "sink", *args], stdout=log, stderr=subprocess.STDOUT, env=env
    )


def test_killed_sink_restarts_without_loss_or_duplicates(kafka_settings, tmp_path):
    """SIGKILL mid-stream (no graceful anything), restart, then SIGTERM: each event exactly once, offsets at the end."""
    from feedback import bus

    run = uuid.uuid4().hex[:6]
    url = f"sqlite:///{tmp_path / 'kill.db'}"
    comps = [completion(f"{run}-c{i}") for i in range(200)]
    events = [e for c in comps for e in events_for(c.completion_id, "view", "select", "view", "dismiss", "view")]
    with private_topics(kafka_settings) as topics:
        settings = sink_settings(kafka_settings, url, topics, batch_size=25)
        produce(
            kafka_settings,
            [(topics[0], c) for c in comps] + [(topics[1], e) for e in events] + [(topics[1], e) for e in events[::4]],
        )
        engine = db.make_engine(url)
        db.upgrade(engine)
        log = open(tmp_path / "sink.log", "wb")
        first = _sink_cli(settings, log)
        try:
            at_kill = wait_until(lambda: count(engine, "events"), 60, "the first sink to store events", interval_s=0.02)
        finally:
            first.kill()  # SIGKILL: no batch finished, no offsets committed on the way out
            first.wait(10)
        assert 0 < at_kill < len(events), f"kill landed at {at_kill} of {len(events)}: not mid-stream"

        produced = len(comps) + len(events) + len(events[::4])

        def committed() -> int:
            admin = bus.admin(kafka_settings.kafka)
            try:
                offsets = admin.list_group_offsets(settings.sink.group_id)[settings.sink.group_id]
            finally:
                admin.close()
            return sum(o.offset for o in offsets.values())

        second = _sink_cli(settings, log)
        try:
            wait_until(lambda: count(engine, "events") == len(events), 90, "the restarted sink to store every event")
            # Completions are keyed by user and file, events by completion: an event held for its
            # completion is stored when that arrives, maybe before its own retries are read.
            wait_until(lambda: committed() == produced, 90, "the restarted sink to read every message")
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0, (tmp_path / "sink.log").read_text()[-2000:]
        log.close()
        assert "stopped after" in (tmp_path / "sink.log").read_text()

        with engine.connect() as conn:
            ids = list(conn.execute(select(db.events.c.event_id)).scalars())
        assert sorted(ids) == sorted(str(e.event_id) for e in events)  # all there, none twice
        assert count(engine, "completions") == len(comps)

        assert committed() == produced  # and the graceful stop rewound nothing
        engine.dispose()


def test_broker_restart_mid_stream_loses_nothing(tmp_path):
    """A broker of its own, stopped and started again under a running sink and producer."""
    from feedback import bus
    from feedback.producer import BufferedProducer
    from ops import kafka_broker
    from tests.helpers import free_port, make_settings

    s = make_settings(tmp_path, kafka={"port": free_port(), "controller_port": free_port()})
    url = f"sqlite:///{tmp_path / 'restart.db'}"
    comps = [completion(f"r-c{i}") for i in range(100)]
    events = [e for c in comps for e in events_for(c.completion_id, "view", "select", "dismiss")]
    half = len(events) // 2
    kafka_broker.start(s, progress=lambda m: None)
    producer = None
    try:
        bus.wait_until_ready(s.kafka, 90)
        bus.ensure_topics(s.kafka)
        settings = sink_settings(s, url, (bus.COMPLETIONS, bus.EVENTS))
        engine = db.make_engine(url)
        db.upgrade(engine)
        producer = BufferedProducer(s.kafka, retry_backoff_s=0.2)
        with running_sink(settings):
            for c in comps:
                producer.send(bus.COMPLETIONS, c)
            for e in events[:half]:
                producer.send(bus.EVENTS, e)
            wait_until(lambda: count(engine, "events") >= half // 2, 60, "rows before the restart")
            kafka_broker.stop(s)
            for e in events[half:]:  # the broker is down: the producer buffers them
                producer.send(bus.EVENTS, e)
            kafka_broker.start(s, progress=lambda m: None)
            bus.wait_until_ready(s.kafka, 90)
            wait_until(lambda: count(engine, "events") == len(events), 120, "every event after the restart")
        with engine.connect() as conn:
            ids = list(conn.execute(select(db.events.c.event_id)).scalars())
        assert sorted(ids) == sorted(str(e.event_id) for e in events)
        assert count(engine, "completions") == len(comps) and count(engine, "dead_letters") == 0
        engine.dispose()
    finally:
        if producer is not None:
            producer.close(timeout_s=2)
        kafka_broker.stop(s)


def test_a_sink_started_while_the_database_does_not_answer_waits_a_refusal_does_not():
    """A supervisor may restart a killed sink while PostgreSQL itself restarts (the soak does)."""
    import threading
    import time

    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from feedback.sink.loop import SinkSection, _wait_for_database
    from tests.helpers import free_port

    cfg = SinkSection(db_start_wait_s=scaled(1.0), db_retry_s=0.1)
    down = create_engine(f"postgresql+psycopg://flywheel:pw@127.0.0.1:{free_port()}/flywheel")
    t0 = time.monotonic()
    _wait_for_database(down, cfg, threading.Event())
    assert time.monotonic() - t0 >= scaled(1.0)  # waited its bound, then lets the upgrade say why
    down.dispose()

    url = os.environ.get("FLYWHEEL_TEST_POSTGRES_URL")
    if url:  # a server that answers no is not waited for
        refused = create_engine(make_url(url).set(password="not-the-password"))
        t0 = time.monotonic()
        _wait_for_database(refused, cfg, threading.Event())
        assert time.monotonic() - t0 < scaled(1.0)
        refused.dispose()


def test_a_database_lost_while_the_sink_migrates_at_start_is_waited_for_again(monkeypatch):
    """The soak's restarted sink met a PostgreSQL crash between its first connection and the
    migration; it waits again (within db_start_wait_s) rather than exit. A refusal still ends it."""
    import threading

    from sqlalchemy import create_engine

    from feedback.core.errors import UserError
    from feedback.sink import loop
    from tests.helpers import free_port

    monkeypatch.setattr(loop, "_wait_for_database", lambda *a, **k: None)
    cfg = loop.SinkSection(db_start_wait_s=scaled(30.0), db_retry_s=0.01)
    engine = create_engine(f"postgresql+psycopg://flywheel:pw@127.0.0.1:{free_port()}/flywheel")
    calls = []

    def crashes_once(_engine):
        calls.append(1)
        if len(calls) == 1:
            raise UserError("database is unreachable: server closed the connection unexpectedly")

    loop._start_database(engine, cfg, threading.Event(), upgrade=crashes_once)
    assert len(calls) == 2

    def refuses(_engine):
        calls.append(1)
        raise UserError('database is unreachable: FATAL:  password authentication failed for user "flywheel"')

    calls.clear()
    with pytest.raises(UserError, match="password authentication failed"):
        loop._start_database(engine, cfg, threading.Event(), upgrade=refuses)
    assert len(calls) == 1
    engine.dispose()
