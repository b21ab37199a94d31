"""Messages round-trip through the real Kafka broker with kafka-python."""

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
