"""Retention drops text older than N days and keeps token ids (the privacy control)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from feedback import db
from feedback.schemas import FeedbackEvent, encode
from feedback.sink import ingest, retention
from feedback.sink.ingest import Batch, Origin
from feedback.sink.loop import _retention
from tests.feedback.sink.sink_support import completion
from tests.helpers import flywheel

NOW = datetime.now(UTC)


def load(url: str) -> None:
    engine = db.make_engine(url)
    db.upgrade(engine)
    old, new = NOW - timedelta(days=40), NOW - timedelta(days=1)
    comps = [
        (completion(cid, created_at=at, before_cursor="x = ", after_cursor="\n"), Origin("c", 0, i, None, None))
        for i, (cid, at) in enumerate([("old", old), ("new", new)])
    ]
    evs = [
        (e, Origin("e", 0, i, None, encode(e)))
        for i, e in enumerate(
            FeedbackEvent(completion_id=cid, type="edit", kept_text="kept", created_at=at)
            for cid, at in [("old", old), ("new", new)]
        )
    ]
    with engine.begin() as conn:
        ingest.write_batch(conn, Batch(completions=comps, events=evs), now=NOW, feedback_window_s=60)
        for i, at in enumerate([old, new]):
            conn.execute(
                db.dead_letters.insert().values(
                    ingest.dead_letter_row(Origin("e", 1, i, None, b"secret"), "malformed", "x", at)
                )
            )
    engine.dispose()


def snapshot(engine) -> dict:
    with engine.connect() as conn:
        return {
            "prompt_text": dict(
                conn.execute(select(db.completions.c.completion_id, db.completions.c.prompt_text)).all()
            ),
            "cursor": {
                r[0]: (r[1], r[2])
                for r in conn.execute(
                    select(
                        db.completions.c.completion_id, db.completions.c.before_cursor, db.completions.c.after_cursor
                    )
                )
            },
            "prompt_token_ids": dict(
                conn.execute(select(db.completions.c.completion_id, db.completions.c.prompt_token_ids)).all()
            ),
            "text": dict(
                conn.execute(select(db.completion_choices.c.completion_id, db.completion_choices.c.text)).all()
            ),
            "token_ids": dict(
                conn.execute(select(db.completion_choices.c.completion_id, db.completion_choices.c.token_ids)).all()
            ),
            "n_chars": dict(
                conn.execute(select(db.completion_choices.c.completion_id, db.completion_choices.c.n_chars)).all()
            ),
            "kept_text": dict(conn.execute(select(db.events.c.completion_id, db.events.c.kept_text)).all()),
            "payload": [
                bytes(p) if p is not None else None
                for p in conn.execute(
                    select(db.dead_letters.c.payload).order_by(db.dead_letters.c.kafka_offset)
                ).scalars()
            ],
        }


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_retention_nulls_old_text_and_keeps_token_ids(backend, request, tmp_path):
    url = f"sqlite:///{tmp_path / 'r.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    load(url)
    engine = db.make_engine(url)
    before = snapshot(engine)
    with engine.begin() as conn:
        dropped = retention.apply_retention(conn, now=NOW, retention_days=30)
    assert dropped == {
        "completions.prompt_text": 1,
        "completions.cursor_text": 1,
        "completion_choices.text": 1,
        "events.kept_text": 1,
        "dead_letters.payload": 1,
    }
    after = snapshot(engine)
    assert after["prompt_text"] == {"old": None, "new": "def f():\n"}
    assert after["cursor"] == {"old": (None, None), "new": ("x = ", "\n")}
    assert after["text"] == {"old": None, "new": "hello world"}
    assert after["kept_text"] == {"old": None, "new": "kept"}
    assert after["payload"] == [None, b"secret"]
    for kept in ("prompt_token_ids", "token_ids", "n_chars"):  # what training and the views read
        assert after[kept] == before[kept]
    with engine.begin() as conn:  # nothing left to drop
        assert set(retention.apply_retention(conn, now=NOW, retention_days=30).values()) == {0}
    engine.dispose()


def test_the_sink_step_reports_what_it_dropped(tmp_path):
    url = f"sqlite:///{tmp_path / 's.db'}"
    load(url)
    engine = db.make_engine(url)
    lines = []
    _retention(engine, 30, lines.append)
    assert lines == [
        "sink: retention dropped text older than 30 days: 1 completions.prompt_text, 1 completions.cursor_text, 1 completion_choices.text, 1 events.kept_text, 1 dead_letters.payload"
    ]
    engine.dispose()


def test_cli_retention(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    load(url)
    env = {"FLYWHEEL_DATABASE__URL": url}
    r = flywheel("retention", "--set", "sink.retention_days=7", env=env, tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "1 completions.prompt_text" in r.stdout and "sink.retention_days" in r.stdout  # the resolved config
    r = flywheel("retention", "--set", "sink.retention_days=0", env=env, tmp_path=tmp_path)
    assert r.returncode == 0 and "retention is off" in r.stdout


def test_cli_retention_deletes_old_bookkeeping_even_with_text_kept(tmp_path):
    """`flywheel retention` stopped at "retention is off" and never deleted old dead letters."""
    url = f"sqlite:///{tmp_path / 'k.db'}"
    engine = db.make_engine(url)
    db.upgrade(engine)
    _bookkeeping(engine, dead_ages_days=[40, 1], held_ages_days=[8, 1])
    r = flywheel("retention", "--set", "sink.retention_days=0", env={"FLYWHEEL_DATABASE__URL": url}, tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "retention is off" in r.stdout and "1 dead_letters, 1 pending_events" in r.stdout
    assert _ages(engine) == ([1], [1])
    engine.dispose()


# --- bookkeeping rows are deleted too (reliability finding 3) -----------------------------------


def _bookkeeping(engine, dead_ages_days: list[float], held_ages_days: list[float]) -> None:
    with engine.begin() as conn:
        for i, age in enumerate(dead_ages_days):
            origin = Origin("e", 0, i, None, b"payload")
            conn.execute(
                db.dead_letters.insert().values(
                    ingest.dead_letter_row(origin, "unknown_completion", "x", NOW - timedelta(days=age))
                )
            )
        for i, age in enumerate(held_ages_days):
            e = FeedbackEvent(completion_id=f"ghost{i}", type="view")
            held = ingest.pending_row(e, Origin("e", 1, i, None, encode(e)), NOW - timedelta(days=age))
            conn.execute(db.pending_events.insert().values(held))


def _ages(engine) -> tuple[list[int], list[int]]:
    with engine.connect() as conn:
        dead = sorted(conn.execute(select(db.dead_letters.c.kafka_offset)).scalars())
        held = sorted(conn.execute(select(db.pending_events.c.kafka_offset)).scalars())
    return dead, held


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_retention_deletes_old_dead_letters_and_held_events(backend, request, tmp_path):
    """Events for completions that never arrive were held, then dead-lettered, and no retention
    ever deleted either: a steady stream of them filled the disk."""
    url = f"sqlite:///{tmp_path / 'b.db'}" if backend == "sqlite" else request.getfixturevalue("postgres_url")
    engine = db.make_engine(url)
    db.upgrade(engine)
    _bookkeeping(engine, dead_ages_days=[40, 31, 10, 1], held_ages_days=[8, 1])

    def run(**limits) -> dict[str, int]:
        with engine.begin() as conn:
            return retention.delete_bookkeeping(conn, now=NOW, **limits)

    off = dict(dead_letter_days=0, dead_letter_max_rows=0, pending_days=0)
    assert run(**off) == {"dead_letters": 0, "pending_events": 0}  # 0 turns each limit off
    assert run(**off | {"dead_letter_days": 30, "pending_days": 7}) == {"dead_letters": 2, "pending_events": 1}
    assert _ages(engine) == ([2, 3], [1])  # the 10- and 1-day-old dead letters, the 1-day-old held event
    assert run(**off | {"dead_letter_max_rows": 1}) == {"dead_letters": 1, "pending_events": 0}
    assert _ages(engine) == ([3], [1])  # the newest stays
    assert run(**off | {"dead_letter_max_rows": 1}) == {"dead_letters": 0, "pending_events": 0}
    engine.dispose()


class _IdleConsumer:
    """Stands in for the Kafka consumer: no records; stops the loop after its first pass."""

    def __init__(self, stop):
        self.stop = stop

    def poll(self, timeout_ms, max_records):
        self.stop.set()
        return {}


def test_the_sink_deletes_old_bookkeeping_even_when_text_is_kept_forever(tmp_path):
    """With retention_days = 0 the sink skipped retention altogether."""
    import threading

    from feedback.sink.loop import SinkSettings, SinkStats, _loop

    url = f"sqlite:///{tmp_path / 'k.db'}"
    engine = db.make_engine(url)
    db.upgrade(engine)
    _bookkeeping(engine, dead_ages_days=[40, 1], held_ages_days=[])
    settings = SinkSettings(database={"url": url}, sink={"retention_days": 0})
    stop, lines = threading.Event(), []
    _loop(settings, engine, _IdleConsumer(stop), stop, SinkStats(), lines.append)
    assert _ages(engine) == ([1], [])
    assert "sink: retention deleted 1 dead_letters, 0 pending_events" in lines
    engine.dispose()


def test_held_events_must_outlive_the_grace_period():
    from feedback.core.errors import UserError
    from feedback.sink.loop import SinkSettings

    with pytest.raises(UserError, match="pending_retention_days"):
        SinkSettings.load(None, ["sink.pending_retention_days=1", "sink.grace_period_s=172800"])
    assert SinkSettings.load(None, ["sink.pending_retention_days=0", "sink.grace_period_s=172800"])
    defaults = SinkSettings().sink
    assert (defaults.dead_letter_retention_days, defaults.dead_letter_max_rows, defaults.pending_retention_days) == (
        30,
        1_000_000,
        7,
    )


class _BrokerDownConsumer(_IdleConsumer):
    """The broker stopped: its first polls raise what kafka-python raises, then it answers again."""

    def __init__(self, stop, failures: int):
        super().__init__(stop)
        self.failures = failures

    def poll(self, timeout_ms, max_records):
        from kafka.errors import KafkaConnectionError

        if self.failures:
            self.failures -= 1
            raise KafkaConnectionError("111 ECONNREFUSED")
        return super().poll(timeout_ms, max_records)


def test_the_sink_waits_out_a_stopped_broker(tmp_path):
    """A poll while the broker was stopped raised KafkaConnectionError out of the loop: the sink
    exited with `internal error` (the soak's broker fault found it). Now it polls again."""
    import threading

    from feedback.sink.loop import SinkSettings, SinkStats, _loop

    url = f"sqlite:///{tmp_path / 'k.db'}"
    engine = db.make_engine(url)
    db.upgrade(engine)
    settings = SinkSettings(database={"url": url}, sink={"kafka_retry_s": 0.01})
    stop = threading.Event()
    consumer = _BrokerDownConsumer(stop, failures=3)
    _loop(settings, engine, consumer, stop, SinkStats(), lambda line: None)
    assert consumer.failures == 0 and stop.is_set()  # polled through the outage until the loop's stop
    engine.dispose()
