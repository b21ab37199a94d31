"""The buffered producer: never blocks the caller, holds records while Kafka is away, counts overflow."""

import time
import uuid

import pytest

from feedback import bus
from feedback.producer import BufferedProducer
from feedback.schemas import FeedbackEvent
from ops import kafka_broker
from tests.helpers import free_port, make_settings, scaled


def test_unreachable_broker_buffers_then_counts_overflow(tmp_path):
    s = make_settings(tmp_path, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    p = BufferedProducer(s.kafka, max_buffered=5, retry_backoff_s=0.1)
    t0 = time.perf_counter()
    accepted = [p.send(bus.EVENTS, FeedbackEvent(completion_id="c", type="view")) for _ in range(8)]
    assert time.perf_counter() - t0 < 0.5  # never waits for Kafka
    assert accepted == [True] * 5 + [False] * 3
    assert p.dropped == 3 and p.buffered == 5 and p.delivered == 0
    assert not p.flush(timeout_s=0.2)


@pytest.mark.slow
@pytest.mark.kafka
def test_records_wait_for_the_broker_and_arrive_in_order(tmp_path):
    s = make_settings(tmp_path, kafka={"port": free_port(), "controller_port": free_port()})
    p = BufferedProducer(s.kafka, retry_backoff_s=0.2)
    cid = f"c-{uuid.uuid4().hex}"
    sent = [FeedbackEvent(completion_id=cid, type="view") for _ in range(20)]
    for e in sent:
        assert p.send(bus.EVENTS, e)
    assert p.buffered == 20  # no broker yet
    kafka_broker.start(s, progress=lambda m: None)
    try:
        bus.wait_until_ready(s.kafka, 90)
        bus.ensure_topics(s.kafka)
        assert p.flush(timeout_s=scaled(60)), f"{p.buffered} records still buffered"
        assert p.delivered == 20 and p.dropped == 0
        c = bus.consumer(s.kafka, bus.EVENTS, group_id="t", consumer_timeout_ms=int(scaled(10_000)))
        got = [m.value for m in c if m.key == cid.encode()]
        c.close()
        assert [FeedbackEvent.model_validate_json(v).event_id for v in got] == [e.event_id for e in sent]
    finally:
        p.close(timeout_s=2)
        kafka_broker.stop(s)
