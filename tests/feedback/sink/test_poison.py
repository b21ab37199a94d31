"""A poison message never stops the sink (reliability finding 1), over a real Kafka broker.

Each poison record goes to the topic as raw bytes, the way a buggy or hostile producer would
send it, followed by valid messages. The valid ones must be stored, the poison ones must be
dead letters with their reason, and the sink must commit past them: a second sink in the same
consumer group finds nothing left to read. Before the fix, a value SQLite cannot hold (2**63)
raised OverflowError out of the sink's write path, and a completion from the year 9999
overflowed its feedback window; the sink exited without committing, and every restart
replayed the same batch.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import select

from feedback import db
from feedback.schemas import FeedbackEvent, encode
from tests.feedback.sink.sink_support import (
    completion,
    count,
    private_topics,
    produce,
    running_sink,
    sink_settings,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'poison.db'}"
    return request.getfixturevalue("postgres_url")


def raw(msg, **overrides) -> bytes:
    """`msg` as JSON with fields overridden, bypassing validation (what a foreign producer could send)."""
    return json.dumps(json.loads(encode(msg)) | overrides).encode()


def test_poison_messages_become_dead_letters_and_ingestion_goes_on(kafka_settings, database_url):
    run = uuid.uuid4().hex[:6]
    anchor, held_old, held_nul = f"{run}-anchor", f"{run}-held-old", f"{run}-held-nul"
    view = FeedbackEvent(completion_id=anchor, type="view")
    select_ = FeedbackEvent(completion_id=anchor, type="select")
    comp = completion(f"{run}-poison")
    # payload -> (topic index: 0 completions / 1 events, a fragment of the dead letter's error)
    poison = {
        raw(select_, accepted_chars=2**63): (1, "accepted_chars"),
        raw(select_, accepted_chars=2**31): (1, "accepted_chars"),  # PostgreSQL INTEGER overflows
        raw(view, elapsed_ms=2**63): (1, "elapsed_ms"),
        raw(view, choice_index=2**63): (1, "choice_index"),
        raw(view, created_at="9999-12-31T23:59:59Z"): (1, "created_at"),
        raw(view, created_at="0001-01-01T00:00:00+01:00"): (1, "created_at"),  # out of range once in UTC
        raw(comp, created_at="9999-12-31T23:59:59Z"): (0, "created_at"),  # its feedback window overflowed
        raw(comp, model_version=2**63): (0, "model_version"),
        raw(comp, prompt_token_ids=[2**64]): (0, "prompt_token_ids"),
    }
    # Validates, but PostgreSQL text cannot hold NUL: in an id (not rewritten, unlike code) it is a
    # refusal by the database itself (SQLite stores it).
    nul_edit = FeedbackEvent(completion_id=held_nul, type="view", view_id="a\x00b")
    valid = FeedbackEvent(completion_id=anchor, type="dismiss")
    postgres = database_url.startswith("postgresql")

    with private_topics(kafka_settings) as topics:
        settings = sink_settings(kafka_settings, database_url, topics)
        engine = db.make_engine(database_url)
        db.upgrade(engine)
        with engine.begin() as conn:
            # Held by an older sink whose schemas let 2**63 through: it no longer validates.
            stale = FeedbackEvent(completion_id=held_old, type="select")
            conn.execute(
                db.pending_events.insert().values(
                    event_id=str(stale.event_id),
                    completion_id=held_old,
                    payload=raw(stale, accepted_chars=2**63),
                    kafka_topic=topics[1],
                    kafka_partition=0,
                    kafka_offset=10**9,
                    held_at=datetime.now(UTC),
                )
            )
        produce(kafka_settings, [(topics[0], completion(anchor))])
        produce(kafka_settings, [(topics[i], payload) for payload, (i, _) in poison.items()])
        produce(kafka_settings, [(topics[1], nul_edit)])
        with running_sink(settings):
            wait_until(lambda: count(engine, "pending_events") == 2, 60, "the NUL edit held beside the stale event")
            produce(kafka_settings, [(topics[0], completion(held_old)), (topics[0], completion(held_nul))])
            produce(kafka_settings, [(topics[1], valid)])

            def settled():
                return (
                    count(engine, "events", event_id=str(valid.event_id)) == 1
                    and count(engine, "completions") == 3
                    and count(engine, "pending_events") == 0
                )

            wait_until(settled, 60, "the valid event and both held completions stored")

        with engine.connect() as conn:
            dead = {bytes(d.payload): d for d in conn.execute(select(db.dead_letters))}
        for payload, (i, fragment) in poison.items():
            d = dead.pop(payload)
            assert (d.reason, d.kafka_topic) == ("malformed", topics[i]) and fragment in d.error, d.error
        stale_dead = dead.pop(raw(stale, accepted_chars=2**63))
        assert stale_dead.reason == "malformed" and "no longer valid" in stale_dead.error
        assert stale_dead.completion_id == held_old and stale_dead.event_id == str(stale.event_id)
        if postgres:
            nul_dead = dead.pop(encode(nul_edit))
            assert nul_dead.reason == "rejected" and nul_dead.event_id == str(nul_edit.event_id)
            assert "database refused it" in nul_dead.error and "0x00" in nul_dead.error
        else:
            assert count(engine, "events", event_id=str(nul_edit.event_id)) == 1
        assert dead == {}  # nothing else was set aside
        assert count(engine, "completions", completion_id=held_nul) == 1  # not taken down by its held event

        # The sink committed past every poison record: a restart (or the group's next member)
        # resumes after them instead of replaying them.
        from feedback import bus

        admin = bus.admin(kafka_settings.kafka)
        try:
            committed = admin.list_group_offsets(settings.sink.group_id)[settings.sink.group_id]
        finally:
            admin.close()
        produced = 1 + len(poison) + 1 + 2 + 1  # anchor, poison, the NUL edit, the held ones' completions, valid
        assert sum(o.offset for o in committed.values()) == produced
        engine.dispose()
