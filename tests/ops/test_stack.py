"""`flywheel up | status | down` against a real Apache Kafka broker, as a user runs them."""

import json

import pytest

from feedback import bus
from tests.helpers import flywheel, free_port, make_settings, scaled

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


def test_up_status_down_keeps_messages(tmp_path):
    kport, cport = free_port(), free_port()
    ports = ["--set", f"kafka.port={kport}", "--set", f"kafka.controller_port={cport}"]
    s = make_settings(tmp_path, kafka={"port": kport, "controller_port": cport})

    r = flywheel("up", *ports, tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "resolved config" in r.stdout  # each process prints its config at start
    try:
        r = flywheel("status", *ports, tmp_path=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "healthy" in r.stdout
        for topic in (bus.COMPLETIONS, bus.EVENTS, bus.VERSIONS):
            assert topic in r.stdout
        topics = {t.name: t for t in bus.describe_topics(s.kafka)}
        assert topics[bus.COMPLETIONS].partitions == s.kafka.completions.partitions
        assert topics[bus.VERSIONS].cleanup_policy == "compact"

        p = bus.producer(s.kafka)
        p.send(bus.EVENTS, key=b"c1", value=json.dumps({"before": "down"}).encode()).get(timeout=scaled(30))
        p.close()
    finally:
        r = flywheel("down", *ports, tmp_path=tmp_path)
    assert r.returncode == 0 and "stopped" in r.stdout, r.stdout + r.stderr

    r = flywheel("status", *ports, tmp_path=tmp_path)
    assert r.returncode == 1 and "not running" in r.stdout

    r = flywheel("up", *ports, tmp_path=tmp_path)  # second start: cached jars, formatted storage
    assert r.returncode == 0, r.stderr
    try:
        c = bus.consumer(s.kafka, bus.EVENTS, group_id="after-restart", consumer_timeout_ms=int(scaled(20_000)))
        values = [json.loads(m.value) for m in c]
        c.close()
        assert {"before": "down"} in values
    finally:
        assert flywheel("down", *ports, tmp_path=tmp_path).returncode == 0


def test_down_without_up_touches_nothing(tmp_path):
    r = flywheel("down", tmp_path=tmp_path)
    assert r.returncode == 0 and "nothing to stop" in r.stdout
