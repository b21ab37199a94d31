"""Messages round-trip through the real Kafka broker with kafka-python."""

import time
import uuid

import pytest

from feedback import bus
from feedback.routing import encode_routing
from feedback.schemas import CompletionChoice, CompletionRecord, FeedbackEvent, ModelVersion, decode, encode, key_of
from tests.helpers import scaled

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


def _consume(s, topic, keys: set[bytes], timeout_ms=20_000):
    c = bus.consumer(s.kafka, topic, group_id=f"t-{uuid.uuid4().hex}", consumer_timeout_ms=int(scaled(timeout_ms)))
    got = {}
    for m in c:
        if m.key in keys:
            got[m.key] = m
        if len(got) == len(keys):
            break
    c.close()
    return got


def test_topics_exist_with_configured_partitions(kafka_settings):
    info = {t.name: t for t in bus.describe_topics(kafka_settings.kafka)}
    for name, spec in bus.topic_specs(kafka_settings.kafka).items():
        assert info[name].partitions == spec.partitions
        assert info[name].retention_ms == str(spec.retention_ms)
    assert bus.ensure_topics(kafka_settings.kafka) == []  # idempotent


@pytest.mark.parametrize(
    "topic, msg",
    [
        (
            bus.COMPLETIONS,
            CompletionRecord(
                completion_id=f"c-{uuid.uuid4().hex}",
                model_version=1,
                user_hash="h",
                prompt_token_ids=[1, 2, 3],
                choices=[CompletionChoice(index=0, token_ids=[4], logprobs=[-0.25], text="x")],
                latency_ms=3.0,
                routing=encode_routing([[[0, 1]], [[2, 3]]]),
            ),
        ),
        (bus.EVENTS, FeedbackEvent(completion_id=f"c-{uuid.uuid4().hex}", type="edit", kept_text="kept")),
        (bus.VERSIONS, ModelVersion(version=7, parent=6, kind="delta", uri="file:///store/7", sha256="f" * 64)),
    ],
)
def test_message_round_trip(kafka_settings, topic, msg):
    p = bus.producer(kafka_settings.kafka)
    meta = p.send(topic, key=key_of(msg), value=encode(msg)).get(timeout=scaled(30))
    p.close()
    got = _consume(kafka_settings, topic, {key_of(msg)})
    m = got[key_of(msg)]
    assert (m.partition, m.offset) == (meta.partition, meta.offset)
    assert decode(type(msg), m.value) == msg


def test_same_key_same_partition_in_order(kafka_settings):
    """A completion's events share a key, so they land on one partition, in order."""
    cid = f"c-{uuid.uuid4().hex}"
    events = [FeedbackEvent(completion_id=cid, type=t) for t in ("view", "select")]
    events.append(FeedbackEvent(completion_id=cid, type="edit", kept_text="y"))
    p = bus.producer(kafka_settings.kafka)
    parts = {p.send(bus.EVENTS, key=key_of(e), value=encode(e)).get(timeout=scaled(30)).partition for e in events}
    p.close()
    assert len(parts) == 1
    c = bus.consumer(
        kafka_settings.kafka, bus.EVENTS, group_id=f"t-{uuid.uuid4().hex}", consumer_timeout_ms=int(scaled(15_000))
    )
    seen = [decode(FeedbackEvent, m.value) for m in c if m.key == cid.encode()]
    c.close()
    assert [e.type for e in seen] == ["view", "select", "edit"]


def test_a_new_group_member_gets_every_partition_at_its_first_join(kafka_settings, caplog):
    """The member knows its topics' partitions before it joins, so the group's leader hands them
    out at once. Without that it assigns nothing at the first join ("No partition metadata") and
    waits for a metadata refresh to rebalance; the one time that refresh was lost, a sink sat
    without partitions for minutes."""
    k = kafka_settings.kafka
    c = bus.consumer(k, bus.COMPLETIONS, bus.EVENTS, group_id=f"t-{uuid.uuid4().hex}", session_timeout_ms=6000)
    try:
        assert c.config["heartbeat_interval_ms"] == 2000 and c.config["metadata_max_age_ms"] == bus.METADATA_MAX_AGE_MS
        with caplog.at_level("WARNING", logger="kafka.coordinator"):
            deadline = time.monotonic() + scaled(30)
            while not c.assignment() and time.monotonic() < deadline:
                c.poll(timeout_ms=200)
        want = {(t, p) for t in (bus.COMPLETIONS, bus.EVENTS) for p in range(bus.topic_specs(k)[t].partitions)}
        assert {(tp.topic, tp.partition) for tp in c.assignment()} == want
        assert not [r for r in caplog.records if "No partition metadata" in r.getMessage()]
    finally:
        c.close()
