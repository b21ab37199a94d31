"""Ingest benchmark: feedback events into SQL through Kafka and the sink, against direct inserts.

Both paths write the same kind of events (each referring to a stored completion) into the
same database in one run, and both are measured the same way, from the rows: throughput is
events / (last `ingested_at` - first `created_at`), lag is `ingested_at - created_at` per
event (p50, p99). `ingested_at` is stamped when the write of the row's batch begins; the
row is visible once that transaction commits, one batch write later (reported for a full
batch written directly).

- direct: the baseline. The events are written straight into the database in batches of
  `sink.batch_size` with the sink's own idempotent write (`ingest.write_batch`), no Kafka.
- sink draining a backlog: the events are in Kafka before a `flywheel sink` process (a
  separate process, as in production) starts; its rate between the first and the last
  stored row is what the sink alone sustains. The producer's own rate is reported too.
- producer -> Kafka -> sink: events go through the real buffered producer (acks=all) to an
  events topic while the sink runs, as fast as the producer sends (the lag then includes
  any backlog), then paced at half that rate for 10 s (the lag of a pipeline that keeps up), or
  at `paced_rate` for `paced_s` (e.g. 5,000 events/s for 60 s: the rate a deployment must hold).

The events are handed to `send_events(list[FeedbackEvent])`, by default the Kafka producer.
An HTTP sender (POST /v1/events/batch) plugs in there; the API then produces to
`events_topic`, which the benchmark passes on to the sink. With a sender, the same number
of events also go producer -> Kafka -> sink in the same run (the baseline the HTTP path is
a ratio of: same sink, same database, same load on the machine).

Lost events: those sent (and not refused by the sender) that never reached the database.
A phase waits until all arrived or none arrived for `stall_s`; the shortfall is reported
rather than raised, so a lossy run still prints its numbers.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from kafka.errors import KafkaError

from feedback.core.errors import UserError
from feedback.core.stats import percentile
from feedback.schemas import CompletionChoice, CompletionRecord, FeedbackEvent

EventSender = Callable[[list[FeedbackEvent]], None]


@dataclass
class PathResult:
    path: str
    events: int
    seconds: float
    events_per_s: float
    lag_p50_ms: float
    lag_p99_ms: float
    offered_per_s: float | None = None
    """Paced send rate; None when sent as fast as possible."""
    lost: int = 0
    """Events sent that never reached the database (refused ones included)."""


@dataclass
class IngestBenchResult:
    database: str
    batch_size: int
    direct: PathResult
    sink_drain: PathResult
    """The sink alone: a backlog already in Kafka, rate between its first and last stored row."""
    kafka: PathResult
    kafka_paced: PathResult | None
    producer_per_s: float
    """Rate at which the buffered producer got the backlog acknowledged by Kafka."""
    batch_write_p50_ms: float
    """Time to write and commit one full batch directly: rows become visible that long after
    their `ingested_at`, which is stamped when the batch's write begins."""
    throughput_ratio: float
    """End to end (kafka) events/s / direct events/s."""
    drain_ratio: float
    """Sink drain events/s / direct events/s."""
    producer_e2e: PathResult | None = None
    """With a sender (HTTP): the same events through the producer -> Kafka -> sink, same run."""
    sender_vs_producer: float | None = None
    """End to end through the sender (kafka) events/s / producer_e2e events/s."""
    refused: int = 0
    """Events the sender's requests did not get accepted (HTTP errors, non-accepted items)."""


def make_completion(cid: str, *, now: datetime | None = None) -> CompletionRecord:
    tokens = [5, 6, 7, 8]
    return CompletionRecord(
        completion_id=cid,
        model_version=1,
        user_hash="bench",
        language="python",
        prompt_token_ids=list(range(64)),
        choices=[CompletionChoice(index=0, token_ids=tokens, logprobs=[-0.5] * len(tokens), text="x = 1\n")],
        latency_ms=20.0,
        prompt_text="def f():\n    " * 8,
        created_at=now or datetime.now(UTC),
    )


def make_events(cids: list[str], n: int, offset: int = 0) -> list[FeedbackEvent]:
    """`n` events over the completions in turn (view, select, view, dismiss, ...), stamped now."""
    now = datetime.now(UTC)
    types = ("view", "select", "view", "dismiss")
    return [
        FeedbackEvent(completion_id=cids[(offset + i) % len(cids)], type=types[(offset + i) % 4], created_at=now)
        for i in range(n)
    ]


def measure(
    engine,
    prefix: str,
    path: str,
    offered: float | None = None,
    from_first_row: bool = False,
    lost_of: int | None = None,
) -> PathResult:
    """Throughput and lag of the events whose completion ids start with `prefix`, from their rows.

    Throughput spans first `created_at` to last `ingested_at`, or first to last `ingested_at`
    with `from_first_row` (a backlog: how fast the sink alone stores). `lost_of`: how many were
    sent, to report the shortfall."""
    from sqlalchemy import select

    from feedback import db
    from feedback.core.clock import as_utc as utc

    ev = db.events
    with engine.connect() as conn:
        rows = conn.execute(
            select(ev.c.created_at, ev.c.ingested_at).where(ev.c.completion_id.like(f"{prefix}%"))
        ).all()
    created = [utc(r.created_at) for r in rows]
    ingested = [utc(r.ingested_at) for r in rows]
    lags = [(i - c).total_seconds() * 1000 for c, i in zip(created, ingested)]
    span = (max(ingested) - min(ingested if from_first_row else created)).total_seconds() if rows else float("nan")
    return PathResult(
        path,
        len(rows),
        span,
        len(rows) / span if span else float("nan"),
        percentile(lags, 0.50),
        percentile(lags, 0.99),
        offered,
        max(0, lost_of - len(rows)) if lost_of is not None else 0,
    )


# --- the baseline: direct inserts --------------------------------------------------------------


def run_direct(engine, *, n_events: int, cids: list[str], batch_size: int) -> list[float]:
    """Write the events in batches; the seconds each batch took to write and commit."""
    from feedback.sink import ingest
    from feedback.sink.ingest import Batch, Origin

    now = datetime.now(UTC)
    with engine.begin() as conn:
        comps = [(make_completion(c, now=now), Origin("direct", 0, i, None, None)) for i, c in enumerate(cids)]
        ingest.write_batch(conn, Batch(completions=comps), now=now, feedback_window_s=3600)
    took = []
    for start in range(0, n_events, batch_size):
        events = make_events(cids, min(batch_size, n_events - start), start)
        batch = Batch(events=[(e, Origin("direct", 0, start + i, None, None)) for i, e in enumerate(events)])
        t0 = time.perf_counter()
        with engine.begin() as conn:
            ingest.write_batch(conn, batch, now=datetime.now(UTC), feedback_window_s=3600)
        took.append(time.perf_counter() - t0)
    return took


# --- the measured path: producer -> Kafka -> sink process -> SQL -------------------------------


def sink_process(
    settings, *, database_url: str, completions_topic: str, events_topic: str, group_id: str, log
) -> subprocess.Popen:
    """`flywheel sink` in its own process, pointed at the benchmark's topics and database."""
    s = settings.sink
    overrides = {
        "data_dir": str(settings.data_dir),
        "kafka.bootstrap_servers": settings.kafka.bootstrap,
        "database.url": database_url,
        "sink.group_id": group_id,
        "sink.completions_topic": completions_topic,
        "sink.events_topic": events_topic,
        "sink.batch_size": s.batch_size,
        "sink.max_batch_wait_s": s.max_batch_wait_s,
        "sink.feedback_window_s": 3600,
        "sink.retention_days": 0,
        "sink.progress_interval_s": 5,
    }
    overrides |= _client_security(settings.kafka)
    args = [a for k, v in overrides.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    # Passwords through the environment: a command line is readable by every user of the machine.
    for name in ("sasl_password", "ssl_key_password"):
        if secret := getattr(settings.kafka, name):
            env[f"FLYWHEEL_KAFKA__{name.upper()}"] = secret.get_secret_value()
    return subprocess.Popen(
        [sys.executable, "-m", "ops.cli", "sink", *args], stdout=log, stderr=subprocess.STDOUT, env=env
    )


def _client_security(k) -> dict:
    """The settings a client process needs to reach the same cluster as `k`, as `--set` overrides
    (the local sasl_ssl broker is, to it, a cluster at `kafka.bootstrap_servers` with that CA)."""
    names = ("security_protocol", "ssl_cafile", "ssl_system_trust", "ssl_certfile", "ssl_keyfile")
    names += ("ssl_check_hostname", "sasl_mechanism", "sasl_username")
    values = {name: getattr(k, name) for name in names}
    return {
        f"kafka.{name}": str(v) if not isinstance(v, bool) else v for name, v in values.items() if v not in (None, "")
    }


def _count(engine, prefix: str) -> int:
    from sqlalchemy import func, select

    from feedback import db

    with engine.connect() as conn:
        return conn.execute(
            select(func.count()).select_from(db.events).where(db.events.c.completion_id.like(f"{prefix}%"))
        ).scalar_one()


def _wait_for(
    engine,
    prefix: str,
    n: int,
    sink: subprocess.Popen,
    timeout_s: float,
    table: str = "events",
    stall_s: float | None = None,
) -> int:
    """Wait until `n` rows of `prefix` are stored, and return how many are. Without `stall_s`,
    fewer than `n` within `timeout_s` raises; with it, the wait also ends once nothing new
    arrived for `stall_s`, and the caller reports the shortfall as lost."""
    from sqlalchemy import func, select

    from feedback import db

    t = db.metadata.tables[table]
    deadline = time.monotonic() + timeout_s
    got, last, since = 0, -1, time.monotonic()
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            got = conn.execute(
                select(func.count()).select_from(t).where(t.c.completion_id.like(f"{prefix}%"))
            ).scalar_one()
        if got >= n:
            return got
        if sink.poll() is not None:
            raise RuntimeError(f"the sink exited with code {sink.returncode} after storing {got} of {n} {table}")
        if got != last:
            last, since = got, time.monotonic()
        elif stall_s is not None and time.monotonic() - since > stall_s:
            return got
        time.sleep(0.1)
    if stall_s is not None:
        return got
    raise RuntimeError(f"only {got} of {n} {table} arrived within {timeout_s:.0f}s")


def _queue(producer, topic: str, msgs, room_bytes: int) -> None:
    """Queue `msgs`, first waiting while the producer holds more than half of `room_bytes` (its
    buffer's size): a run queues more than the buffer holds (300,000 events and their 75,000
    completions per phase are hundreds of MB), and a full buffer drops records."""
    for m in msgs:
        while producer.buffered_bytes > room_bytes // 2:
            time.sleep(0.002)
        producer.send(topic, m)


def _send_paced(send: EventSender, cids: list[str], n: int, rate: float | None, offset: int, chunk: int = 100) -> None:
    t0 = time.monotonic()
    for start in range(0, n, chunk):
        if rate:
            ahead = t0 + start / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        send(make_events(cids, min(chunk, n - start), offset + start))


def run_ingest_bench(
    settings,
    *,
    n_events: int = 20_000,
    events_per_completion: int = 4,
    database_url: str | None = None,
    send_events: EventSender | None = None,
    events_topic: str | None = None,
    send_chunk: int = 100,
    refused: Callable[[], int] = lambda: 0,
    paced: bool = True,
    paced_rate: float | None = None,
    paced_s: float = 10.0,
    progress: Callable[[str], None] = lambda m: None,
    timeout_s: float = 600.0,
    stall_s: float = 30.0,
) -> IngestBenchResult:
    """Run both paths against one database; `send_events` replaces the producer (e.g. HTTP)."""
    from feedback import db
    from feedback.producer import BufferedProducer

    run = uuid.uuid4().hex[:8]
    bench_dir = settings.data_dir / "bench"
    bench_dir.mkdir(parents=True, exist_ok=True)
    url = database_url or f"sqlite:///{bench_dir / f'ingest-{run}.db'}"
    engine = db.make_engine(url)
    db.upgrade(engine)
    n_comp = max(1, math.ceil(n_events / events_per_completion))
    batch_size = settings.sink.batch_size
    phases = "qkp" + ("b" if send_events else "")  # b: the producer baseline beside a sender
    ids = {phase: [f"b{phase}{run}-{i}" for i in range(n_comp)] for phase in "d" + phases}

    progress(
        f"direct: {n_events} events in batches of {batch_size} into {engine.url.render_as_string(hide_password=True)}"
    )
    batch_s = run_direct(engine, n_events=n_events, cids=ids["d"], batch_size=batch_size)
    direct = measure(engine, f"bd{run}-", "direct")
    progress(f"direct: {direct.events_per_s:,.0f} events/s")

    c_topic = f"flywheel.bench-{run}.completions"
    e_topic = events_topic or f"flywheel.bench-{run}.events"
    own_topics = [c_topic, e_topic]  # a sender's topic too: it is the run's own
    _create_topics(settings, own_topics)
    producer = BufferedProducer(settings.kafka, max_buffered=max(100_000, 2 * n_events))
    room = settings.kafka.producer_buffer_bytes
    direct_send = lambda evs: _queue(producer, e_topic, evs, room)  # noqa: E731
    send = send_events or direct_send
    chunk = send_chunk if send_events else 100
    log = open(bench_dir / f"sink-{run}.log", "wb")

    def start_sink():
        return sink_process(
            settings,
            database_url=url,
            completions_topic=c_topic,
            events_topic=e_topic,
            group_id=f"bench-{run}",
            log=log,
        )

    sink = start_sink()
    try:
        # Every phase's completions first, so that the timed phases store events only.
        _queue(producer, c_topic, (make_completion(c) for phase in phases for c in ids[phase]), room)
        producer.flush(timeout_s)
        for phase in phases:
            _wait_for(engine, f"b{phase}{run}-", n_comp, sink, timeout_s, table="completions")
        _stop(sink)

        progress(f"kafka: {n_events} events into the topic while the sink is stopped")
        t0 = time.perf_counter()
        _send_paced(send, ids["q"], n_events, None, 0, chunk)
        producer.flush(timeout_s)
        produced_per_s = n_events / (time.perf_counter() - t0)
        sink = start_sink()
        _wait_for(engine, f"bq{run}-", n_events, sink, timeout_s, stall_s=stall_s)
        drain = measure(engine, f"bq{run}-", "sink draining a backlog", from_first_row=True)
        progress(f"kafka: producer {produced_per_s:,.0f} events/s; sink drained {drain.events_per_s:,.0f} events/s")

        producer_e2e = None
        if send_events:
            progress(f"kafka: {n_events} events end to end through the producer (the baseline), as fast as possible")
            _send_paced(direct_send, ids["b"], n_events, None, 0)
            producer.flush(timeout_s)
            _wait_for(engine, f"bb{run}-", n_events, sink, timeout_s, stall_s=stall_s)
            producer_e2e = measure(engine, f"bb{run}-", "producer -> Kafka -> sink", lost_of=n_events)
            progress(f"kafka: producer end to end {producer_e2e.events_per_s:,.0f} events/s")

        progress(f"kafka: {n_events} events end to end, sent as fast as possible")
        _send_paced(send, ids["k"], n_events, None, 0, chunk)
        producer.flush(timeout_s)
        _wait_for(engine, f"bk{run}-", n_events, sink, timeout_s, stall_s=stall_s)
        kafka = measure(
            engine,
            f"bk{run}-",
            "HTTP -> Kafka -> sink" if send_events else "producer -> Kafka -> sink",
            lost_of=n_events,
        )
        progress(
            f"kafka: {kafka.events_per_s:,.0f} events/s, lag p50 {kafka.lag_p50_ms:.0f} ms, "
            f"p99 {kafka.lag_p99_ms:.0f} ms, {kafka.lost} lost"
        )

        kafka_paced = None
        if paced:
            rate = paced_rate or kafka.events_per_s / 2
            n_paced = max(100, min(n_events, int(rate * paced_s)))
            progress(f"kafka: {n_paced} events paced at {rate:,.0f}/s ({n_paced / rate:.0f} s)")
            _send_paced(send, ids["p"], n_paced, rate, 0, chunk)
            producer.flush(timeout_s)
            _wait_for(engine, f"bp{run}-", n_paced, sink, timeout_s, stall_s=stall_s)
            label = f"same, paced at {rate:,.0f}/s" if paced_rate else "same, paced at half"
            kafka_paced = measure(engine, f"bp{run}-", label, offered=rate, lost_of=n_paced)
    finally:
        producer.close()
        _stop(sink)
        log.close()
        _delete_topics(settings, own_topics)
        engine.dispose()
    return IngestBenchResult(
        database=engine.url.render_as_string(hide_password=True),
        batch_size=batch_size,
        direct=direct,
        sink_drain=drain,
        kafka=kafka,
        kafka_paced=kafka_paced,
        producer_per_s=produced_per_s,
        batch_write_p50_ms=percentile(batch_s, 0.5) * 1000,
        throughput_ratio=kafka.events_per_s / direct.events_per_s,
        drain_ratio=drain.events_per_s / direct.events_per_s,
        producer_e2e=producer_e2e,
        sender_vs_producer=kafka.events_per_s / producer_e2e.events_per_s if producer_e2e else None,
        refused=refused(),
    )


def _stop(sink: subprocess.Popen) -> None:
    if sink.poll() is None:
        sink.send_signal(signal.SIGTERM)
        try:
            sink.wait(30)
        except subprocess.TimeoutExpired:
            sink.kill()
            sink.wait(10)


def _create_topics(settings, names: list[str]) -> None:
    from kafka.admin import NewTopic

    from feedback import bus

    client = bus.admin(settings.kafka)
    try:
        parts = settings.kafka.events.partitions
        client.create_topics(
            [NewTopic(n, num_partitions=parts, replication_factor=1 if settings.kafka.managed else -1) for n in names]
        )
    finally:
        client.close()


def _delete_topics(settings, names: list[str]) -> None:
    from feedback import bus

    try:
        client = bus.admin(settings.kafka)
        try:
            client.delete_topics(names)
        finally:
            client.close()
    except (UserError, KafkaError, OSError):  # best effort: a leftover bench topic is harmless
        pass


def print_result(r: IngestBenchResult, console) -> None:
    from rich.table import Table

    t = Table(
        "path",
        "events",
        "events/s",
        "lag p50 (ms)",
        "lag p99 (ms)",
        "offered/s",
        "lost",
        title=f"ingest into {r.database} (batch {r.batch_size})",
    )
    extra = [r.producer_e2e] if r.producer_e2e else []
    for p in [r.direct, r.sink_drain, *extra, r.kafka] + ([r.kafka_paced] if r.kafka_paced else []):
        t.add_row(
            p.path,
            str(p.events),
            f"{p.events_per_s:,.0f}",
            f"{p.lag_p50_ms:,.1f}",
            f"{p.lag_p99_ms:,.1f}",
            "max" if p.offered_per_s is None else f"{p.offered_per_s:,.0f}",
            str(p.lost),
        )
    console.print(t)
    if r.sender_vs_producer is not None:
        console.print(
            f"HTTP end to end = {r.sender_vs_producer:.2f}x the producer end to end in the same run; "
            f"{r.refused} events refused over HTTP."
        )
    console.print(
        f"end to end = {r.throughput_ratio:.2f}x direct inserts; the sink alone = {r.drain_ratio:.2f}x; "
        f"the producer delivered {r.producer_per_s:,.0f} events/s. Lag ends when a row's batch write begins; "
        f"it commits one batch write later ({r.batch_write_p50_ms:.0f} ms for a full batch of {r.batch_size}). "
        "A drained backlog's lag is its wait in Kafka, not the sink's."
    )
