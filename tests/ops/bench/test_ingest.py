"""The ingest benchmark runs end to end on a small load (its numbers are for the README, not asserted)."""

import pytest

from feedback.sink.loop import SinkSettings
from ops.bench.ingest import run_ingest_bench
from tests.helpers import scaled


@pytest.mark.slow
@pytest.mark.kafka
def test_bench_ingest_smoke(kafka_settings, tmp_path):
    # a producer buffer of 16 KiB: the run queues far more than that (1,600 completions, 400 events
    # a phase), and waits for room rather than dropping
    s = SinkSettings(
        data_dir=str(tmp_path),
        cache_dir=str(kafka_settings.cache_dir),
        kafka=kafka_settings.kafka.model_dump() | {"producer_buffer_bytes": 16 * 1024},
        sink={"batch_size": 50},
    )
    lines = []
    r = run_ingest_bench(s, n_events=400, paced_rate=200, paced_s=0.5, progress=lines.append, timeout_s=scaled(120))
    assert r.direct.events == r.sink_drain.events == r.kafka.events == 400
    assert r.kafka.lost == r.sink_drain.lost == 0
    assert r.throughput_ratio > 0 and r.drain_ratio > 0 and r.producer_per_s > 0
    paced = r.kafka_paced  # the rate asked for, for as long as asked (at least 100 events)
    assert paced.offered_per_s == 200 and paced.events == 100 and paced.lost == 0
    assert paced.path == "same, paced at 200/s"
    assert r.kafka.lag_p99_ms >= r.kafka.lag_p50_ms >= 0
    assert any("sink drained" in line for line in lines)


@pytest.mark.slow
@pytest.mark.kafka
def test_bench_ingest_over_http_batches_loses_nothing_beside_the_producer(kafka_settings, tmp_path):
    from ops.bench.ingest_http import HttpEventSender

    s = SinkSettings(
        data_dir=str(tmp_path),
        cache_dir=str(kafka_settings.cache_dir),
        kafka=kafka_settings.kafka.model_dump(),
        sink={"batch_size": 50},
    )
    sender = HttpEventSender(s, concurrency=2, batch=30)
    try:
        r = run_ingest_bench(
            s,
            n_events=300,
            paced=False,
            send_events=sender.send,
            events_topic=sender.topic,
            send_chunk=sender.chunk,
            refused=lambda: sender.errors,
            timeout_s=scaled(120),
        )
    finally:
        sender.close()
    assert r.kafka.events == r.producer_e2e.events == r.sink_drain.events == 300
    assert r.kafka.lost == r.producer_e2e.lost == 0 and r.refused == 0
    assert r.sender_vs_producer == pytest.approx(r.kafka.events_per_s / r.producer_e2e.events_per_s)
