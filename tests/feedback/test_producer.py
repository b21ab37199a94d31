"""The buffered producer: never blocks the caller, holds records while Kafka is away, counts overflow."""

import time
import uuid

import pytest

from feedback import bus
from feedback.producer import BufferedProducer
from feedback.schemas import FeedbackEvent, encode, key_of
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


def test_the_byte_cap_drops_records_beyond_the_buffer_bytes(tmp_path):
    """The buffer was capped at 10,000 records, whatever their size: completion records carry the
    prompt (up to hundreds of kilobytes each), so a Kafka outage could exhaust the memory."""
    s = make_settings(tmp_path, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    small = FeedbackEvent(completion_id="c", type="view")
    size = len(key_of(small)) + len(encode(small))
    p = BufferedProducer(s.kafka, max_buffered=1_000, max_buffered_bytes=3 * size + 10, retry_backoff_s=0.1)
    try:
        assert [p.send(bus.EVENTS, small) for _ in range(5)] == [True] * 3 + [False] * 2
        assert (p.buffered, p.buffered_bytes, p.dropped) == (3, 3 * size, 2)
        big = FeedbackEvent(completion_id="c", type="edit", kept_text="x" * 50_000)
        assert not p.send(bus.EVENTS, big) and p.dropped == 3  # larger than what is left: dropped, counted
    finally:
        p.close(timeout_s=0.2)


def test_the_byte_cap_comes_from_the_kafka_settings(tmp_path):
    s = make_settings(tmp_path, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}", "producer_buffer_bytes": 4096})
    p = BufferedProducer(s.kafka, retry_backoff_s=0.1)
    try:
        big = FeedbackEvent(completion_id="c", type="edit", kept_text="x" * 5_000)
        assert not p.send(bus.EVENTS, big) and p.dropped == 1 and p.buffered_bytes == 0
        assert p.send(bus.EVENTS, FeedbackEvent(completion_id="c", type="view"))
    finally:
        p.close(timeout_s=0.2)
    assert make_settings(tmp_path).kafka.producer_buffer_bytes == 64 * 2**20  # the default: 64 MiB


def test_one_refused_login_is_logged_once_whatever_reason_each_try_gives(tmp_path, monkeypatch, caplog):
    """A SASL broker answers a wrong password with an error on one try and closes the connection
    on the next: CI logged the one refusal twice. Another refusal is logged again."""
    import logging

    s = make_settings(tmp_path, kafka={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    login = f"Kafka at {s.kafka.bootstrap} {bus.SASL_REFUSED} for user u (SCRAM-SHA-512): "
    refusals = [
        login + "it closed the connection during the login; check ...",
        login + "Authentication failed due to invalid credentials; check ...",
    ] * 3 + ["kafka.ssl_cafile /nowhere/ca.pem does not exist"] * 2
    tries = iter(refusals)

    def refused(*args, **kwargs):
        raise bus.KafkaRefused(next(tries, refusals[-1]))

    monkeypatch.setattr(bus, "producer", refused)
    caplog.set_level(logging.ERROR, logger="feedback.producer")
    p = BufferedProducer(s.kafka, retry_backoff_s=0.01)
    try:
        assert p.send(bus.EVENTS, FeedbackEvent(completion_id="c", type="view"))
        deadline = time.monotonic() + scaled(10)
        while time.monotonic() < deadline:
            logged = [r.getMessage() for r in caplog.records if r.name == "feedback.producer"]
            if len(logged) >= 2:
                break
            time.sleep(0.01)
        time.sleep(0.2)  # more retries, nothing more logged
        logged = [r.getMessage() for r in caplog.records if r.name == "feedback.producer"]
        assert len(logged) == 2, logged
        assert bus.SASL_REFUSED in logged[0] and "ssl_cafile" in logged[1]
        assert p.buffered == 1 and p.delivered == 0  # the record is kept
    finally:
        p.close(timeout_s=0.5)
