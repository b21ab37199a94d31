"""`flywheel sink`: Kafka completions and events into SQL, each row exactly once.

A consumer-group member reads `flywheel.completions` and `flywheel.events`, collects a batch
(up to `batch_size` messages, until it has caught up, or `max_batch_wait_s`), writes it in one database transaction
(feedback/sink/ingest.py: idempotent inserts), and only then commits the batch's offsets. A crash
between the two commits replays the batch, which the unique keys absorb: at-least-once
delivery plus idempotent writes gives exactly-once rows. Several sinks in one group split
the partitions between them.

Each batch also infers feedback for the completions that came before its records in the same
user's file (feedback/implicit.py; `ingest.infer_feedback`): events with source `inferred`,
counted apart (`flywheel_sink_rows_total{table="inferred_events"}`).

Between batches it sweeps: held events whose completion arrived are promoted, those past
the grace period become dead letters, rewards whose feedback window closed are computed,
and text older than `retention_days` is dropped. SIGTERM or SIGINT finishes the batch in
hand, commits it and exits.

A poison message never stops the sink: only "database unavailable" (`database_unavailable`:
connection refused or lost, server shutting down, database locked) keeps a batch and retries
it. Anything else the database (or its driver) refuses, an OverflowError as much as a
DataError, sends the batch through again message by message; the refused message becomes a
`rejected` dead letter with the reason, the rest is written, and the offsets are committed.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Self

from prometheus_client import Counter, Gauge, Histogram
from pydantic import Field, model_validator

from feedback import db
from feedback.core.config import FlywheelSettings, Section
from feedback.core.errors import UserError, first_line
from feedback.db import database_unavailable
from feedback.reward import RewardWeights
from feedback.sink import ingest
from feedback.sink.ingest import Batch, Counts

log = logging.getLogger(__name__)

MESSAGES = Counter("flywheel_sink_messages_total", "Kafka messages the sink consumed", ["topic"])
ROWS = Counter("flywheel_sink_rows_total", "New rows the sink wrote (duplicates excluded)", ["table"])
DEAD_LETTERS = Counter("flywheel_sink_dead_letters_total", "Messages the sink sent to dead_letters", ["reason"])
DB_ERRORS = Counter("flywheel_sink_db_errors_total", "Database failures the sink retried")
KAFKA_ERRORS = Counter("flywheel_sink_kafka_errors_total", "Polls that failed because the broker did not answer")
SWEEP_ERRORS = Counter(
    "flywheel_sink_sweep_errors_total",
    "Sweep steps that failed for a reason other than the database being down",
    ["step"],
)
LAG = Gauge("flywheel_sink_lag_messages", "Messages between the sink's position and the end of its partitions")
BATCH_SECONDS = Histogram("flywheel_sink_batch_seconds", "Time to write a batch and commit its offsets")


class SinkSection(Section):
    """Section `[sink]`."""

    group_id: str = "flywheel-sink"
    """Kafka consumer group; sinks sharing it split the partitions, each message is stored once."""
    completions_topic: str = "flywheel.completions"
    """Topic of completion records."""
    events_topic: str = "flywheel.events"
    """Topic of feedback events."""
    batch_size: int = Field(default=1000, ge=1, le=100_000)
    """Most messages written in one database transaction."""
    max_batch_wait_s: float = Field(default=0.5, gt=0, le=60)
    """A batch is written when it is full, when the consumer has nothing more buffered, or this long after collecting began."""
    session_timeout_ms: int = Field(default=10_000, ge=1_000)
    """A sink that dies without leaving the group loses its partitions after this long (the broker's
    group.min.session.timeout.ms, 6000 by default, is the floor)."""
    grace_period_s: float = Field(default=600.0, ge=0)
    """How long an event waits for its completion record before it becomes a dead letter."""
    feedback_window_s: float = Field(default=300.0, gt=0)
    """Events up to this long after a completion count toward its reward; it is computed when the window closes."""
    reward: RewardWeights = RewardWeights()
    """Reward per outcome (feedback/reward.py)."""
    retention_days: int = Field(default=30, ge=0)
    """Prompt and completion text (and edited text, dead-letter payloads) older than this is set to NULL; token ids stay. 0 keeps text forever."""
    dead_letter_retention_days: int = Field(default=30, ge=0)
    """Dead letters older than this (by `dead_at`) are deleted, rows and all. 0 keeps them forever."""
    dead_letter_max_rows: int = Field(default=1_000_000, ge=0)
    """Most dead letters kept: beyond, the oldest are deleted at each retention pass, so a flood of bad
    messages cannot fill the disk within the retention period. 0: no cap."""
    pending_retention_days: int = Field(default=7, ge=0)
    """Held events older than this (by `held_at`) are deleted. A backstop: the sweep turns them into
    dead letters after `grace_period_s`, which must be shorter. 0 keeps them until the sweep does."""
    retention_interval_s: float = Field(default=3600.0, gt=0)
    """How often the sink applies retention (text, dead letters, held events)."""
    sweep_interval_s: float = Field(default=1.0, gt=0)
    """How often held events, dead letters and due rewards are processed."""
    progress_interval_s: float = Field(default=10.0, gt=0)
    """How often the progress line (rows/s, lag, dead letters) is printed."""
    db_retry_s: float = Field(default=2.0, gt=0)
    """Wait between attempts while the database is unreachable (the batch is kept, offsets are not committed)."""
    db_start_wait_s: float = Field(default=120.0, ge=0)
    """At start, how long to wait for a database that does not answer (restarting, not up yet)
    before giving up with an error; one that answers no (a wrong password) is an error at once."""
    kafka_retry_s: float = Field(default=2.0, gt=0)
    """Wait between polls while the Kafka broker is unreachable (stopped, restarting); what was read
    before is written, and nothing is committed until the broker answers again."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Serve Prometheus metrics on this port; 0 serves none."""
    metrics_host: str = Field(default="127.0.0.1", min_length=1)
    """Address the metrics server listens on: this machine only by default (the metrics name topics,
    groups and error counts); `0.0.0.0` lets a Prometheus on another host scrape it."""

    @model_validator(mode="after")
    def _held_events_outlive_the_grace_period(self) -> Self:
        if self.pending_retention_days and self.pending_retention_days * 86400 <= self.grace_period_s:
            raise ValueError(
                f"sink.pending_retention_days ({self.pending_retention_days}) must be longer than "
                f"sink.grace_period_s ({self.grace_period_s:g}s), or 0: held events would be deleted before the grace period ends"
            )
        return self


class SinkSettings(FlywheelSettings):
    """`flywheel sink` and `flywheel retention`."""

    sink: SinkSection = SinkSection()


@dataclass
class SinkStats:
    messages: int = 0
    batches: int = 0
    counts: Counts = field(default_factory=Counts)
    lag: int | None = None
    partitions: int = 0  # assigned to this member at the last progress line

    @property
    def dead_letters(self) -> int:
        return sum(self.counts.dead_letters.values())


def run_sink(
    settings: SinkSettings,
    *,
    stop: threading.Event | None = None,
    progress: Callable[[str], None] = lambda msg: None,
    handle_signals: bool = False,
) -> SinkStats:
    """Consume until `stop` is set (or SIGTERM/SIGINT with `handle_signals`); return what was written."""
    cfg = settings.sink
    stop = stop or threading.Event()
    restore = _install_signal_handlers(stop) if handle_signals else None
    engine = db.make_engine(settings.database_url, echo=settings.database.echo)
    consumer = metrics = None
    stats = SinkStats()
    try:
        _start_database(engine, cfg, stop)
        consumer = _consumer(settings)
        metrics = serve_metrics(cfg)
        progress(
            f"sink: group {cfg.group_id!r} reading {cfg.completions_topic}, {cfg.events_topic} from {settings.kafka.bootstrap}"
        )
        _loop(settings, engine, consumer, stop, stats, progress)
    finally:
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        if consumer is not None:
            consumer.close(autocommit=False)  # everything written is committed already
        engine.dispose()
        if restore:
            restore()
    progress(f"sink: stopped after {stats.messages} messages; {_summary(stats)}")
    return stats


def _start_database(engine, cfg: SinkSection, stop: threading.Event, upgrade=db.upgrade) -> None:
    """Wait for the database, then migrate it. A server that goes away between the two (it
    crashed right after the sink's start: the soak's restarted sink met a PostgreSQL crash 5 s
    later) is waited for again, within the same `db_start_wait_s`; a refusal is not."""
    deadline = time.monotonic() + cfg.db_start_wait_s
    while True:
        _wait_for_database(engine, cfg, stop, deadline=deadline)
        try:
            upgrade(engine)
            return
        except UserError as e:
            sqlite = engine.dialect.name == "sqlite"  # a file: waiting changes nothing
            if sqlite or stop.is_set() or time.monotonic() >= deadline or _refused(str(e)):
                raise
            log.warning("database lost while migrating at start (%s); waiting for it again", e)
            stop.wait(cfg.db_retry_s)


def _wait_for_database(engine, cfg: SinkSection, stop: threading.Event, *, deadline: float | None = None) -> None:
    """A sink started while the database restarts waits for it, as a running sink waits out an
    outage (a supervisor restarts a killed sink at any moment, the database's own restart
    included). Only a server that does not answer at all is waited for, up to `db_start_wait_s`;
    the first error that is not that is left to the caller's own connection."""
    from sqlalchemy.exc import OperationalError

    if engine.dialect.name == "sqlite":
        return  # a file, not a server: nothing to wait for
    deadline = time.monotonic() + cfg.db_start_wait_s if deadline is None else deadline
    while not stop.is_set():
        try:
            with engine.connect():
                return
        except OperationalError as e:
            if _refused(str(e.orig)) or time.monotonic() >= deadline:
                return  # db.upgrade says what is wrong, in one line
            log.warning("database unreachable at start (%s); trying again in %gs", first_line(e), cfg.db_retry_s)
            stop.wait(cfg.db_retry_s)


# A server that is up but not taking connections yet says so in a FATAL message too.
_RESTARTING = ("starting up", "shutting down", "in recovery mode", "too many clients")


def _refused(message: str) -> bool:
    """Whether the server answered no (a wrong password, no such database or role), rather than
    not answering (connection refused or cut) or restarting."""
    return "FATAL" in message and not any(r in message for r in _RESTARTING)


def serve_metrics(cfg: SinkSection):
    """The Prometheus metrics server on `sink.metrics_host:metrics_port` (a thread), or None when
    the port is 0; `.shutdown()` stops it."""
    if not cfg.metrics_port:
        return None
    from prometheus_client import start_http_server

    try:
        server, _thread = start_http_server(cfg.metrics_port, addr=cfg.metrics_host)
    except OSError as e:
        raise UserError(f"sink metrics: cannot listen on {cfg.metrics_host}:{cfg.metrics_port}: {e.strerror}") from None
    return server


def _consumer(settings: SinkSettings):
    from kafka.errors import KafkaError

    from feedback import bus

    cfg = settings.sink
    try:
        return bus.consumer(
            settings.kafka,
            cfg.completions_topic,
            cfg.events_topic,
            group_id=cfg.group_id,
            max_poll_records=cfg.batch_size,
            session_timeout_ms=cfg.session_timeout_ms,
        )
    except KafkaError as e:
        raise UserError(
            f"Kafka at {settings.kafka.bootstrap} is unreachable ({type(e).__name__}); is `flywheel up` running?"
        ) from None


def _loop(settings: SinkSettings, engine, consumer, stop: threading.Event, stats: SinkStats, progress) -> None:
    cfg = settings.sink
    next_sweep = next_retention = time.monotonic()
    last_report, reported = time.monotonic(), SinkStats()
    while not stop.is_set():
        records = _collect(consumer, cfg.batch_size, cfg.max_batch_wait_s, stop, cfg.kafka_retry_s)
        if records:
            t0 = time.perf_counter()
            batch = ingest.decode_batch(records, completions_topic=cfg.completions_topic, events_topic=cfg.events_topic)
            counts = _write_until_done(engine, batch, settings, stop)
            if counts is None:
                return  # stopped while the database was down: leave the offsets uncommitted
            _commit(consumer, records)
            BATCH_SECONDS.observe(time.perf_counter() - t0)
            stats.messages += len(records)
            stats.batches += 1
            _record(stats, counts)
            for r in records:
                MESSAGES.labels(r.topic).inc()
        now_m = time.monotonic()
        if now_m >= next_sweep:
            next_sweep = now_m + cfg.sweep_interval_s
            _record(stats, _sweep(engine, settings))
        if now_m >= next_retention:
            next_retention = now_m + cfg.retention_interval_s
            if cfg.retention_days:
                _retention(engine, cfg.retention_days, progress)
            _purge(engine, cfg, progress)  # also when text is kept forever: bookkeeping rows must not pile up
        if now_m - last_report >= cfg.progress_interval_s:
            stats.lag, stats.partitions = _lag(consumer)
            progress(_progress_line(stats, reported, now_m - last_report))
            last_report, reported = (
                now_m,
                SinkStats(stats.messages, stats.batches, Counts().add(stats.counts), stats.lag, stats.partitions),
            )


def _collect(consumer, batch_size: int, max_wait_s: float, stop: threading.Event, kafka_retry_s: float) -> list:
    """Up to `batch_size` records: once some arrived, stop at the first poll that finds no more.

    Under light load a batch is written as soon as the consumer has caught up (low lag);
    under heavy load polls keep returning records and batches fill up (high throughput).
    A broker that stops answering ends the batch (what arrived is written) and is polled again
    after `kafka_retry_s`: an outage is waited out, never a reason to exit.
    """
    from kafka.errors import KafkaError

    records: list = []
    deadline = time.monotonic() + max_wait_s
    while len(records) < batch_size and not stop.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        timeout_ms = 0 if records else max(1, int(remaining * 1000))
        try:
            polled = consumer.poll(timeout_ms=timeout_ms, max_records=batch_size - len(records))
        except KafkaError as e:
            KAFKA_ERRORS.inc()
            log.warning("Kafka unreachable (%s); polling again in %gs", first_line(e), kafka_retry_s)
            stop.wait(kafka_retry_s)
            break
        got = [r for part in polled.values() for r in part]
        if records and not got:
            break
        records.extend(got)
    return records


def _write_until_done(engine, batch: Batch, settings: SinkSettings, stop: threading.Event) -> Counts | None:
    """Write the batch, retrying while the database is unavailable; None if stopped meanwhile."""
    while True:
        try:
            return _write(engine, batch, settings)
        except Exception as e:
            if not database_unavailable(e):
                raise  # not even its dead letters could be stored: stop before committing anything
            DB_ERRORS.inc()
            log.warning(
                "database unavailable (%s); retrying the batch in %gs",
                first_line(e, with_type=False),
                settings.sink.db_retry_s,
            )
            if stop.wait(settings.sink.db_retry_s):
                return None


def _write(engine, batch: Batch, settings: SinkSettings) -> Counts:
    now = datetime.now(UTC)
    window = settings.sink.feedback_window_s
    try:
        with engine.begin() as conn:
            return ingest.write_batch(conn, batch, now=now, feedback_window_s=window)
    except Exception as e:
        if database_unavailable(e):
            raise
        # A message the database refuses though it passed validation (a NUL character, which
        # PostgreSQL text cannot hold; a value a driver cannot convert): write one by one so
        # only that one is set aside. Held events are promoted after, one by one too.
        log.warning("batch refused by the database (%s); writing it message by message", first_line(e))
    counts = Counts()
    for one in _singles(batch):
        try:
            with engine.begin() as conn:
                counts.add(ingest.write_batch(conn, one, now=now, feedback_window_s=window, promote=False))
        except Exception as e:
            if database_unavailable(e):
                raise
            counts.add(_reject(engine, one, first_line(e), now))
    counts.add(_promote(engine, now, completion_ids=[rec.completion_id for rec, _ in batch.completions]))
    return counts


def _promote(engine, now: datetime, completion_ids: list[str] | None = None) -> Counts:
    """Promote the held events of `completion_ids` (all when None) in one transaction; if the
    database refuses one, one by one, and the refused ones become `rejected` dead letters."""
    try:
        with engine.begin() as conn:
            return ingest.promote_pending(conn, now=now, completion_ids=completion_ids)
    except Exception as e:
        if database_unavailable(e):
            raise
        log.warning("promoting held events refused by the database (%s); one by one", first_line(e))
    with engine.begin() as conn:
        ids = ingest.promotable(conn, completion_ids=completion_ids)
    counts = Counts()
    for pending_id in ids:
        try:
            with engine.begin() as conn:
                counts.add(ingest.promote_pending(conn, now=now, pending_ids=[pending_id]))
        except Exception as e:
            if database_unavailable(e):
                raise
            with engine.begin() as conn:
                if n := ingest.reject_pending(conn, pending_id, first_line(e), now=now):
                    counts.add(Counts(dead_letters={"rejected": n}))
    return counts


def _singles(batch: Batch):
    for c in batch.completions:
        yield Batch(completions=[c])
    for e in batch.events:
        yield Batch(events=[e])
    for m in batch.malformed:
        yield Batch(malformed=[m])


def _reject(engine, one: Batch, error: str, now: datetime) -> Counts:
    (msg, origin) = (one.completions or one.events or [(None, None)])[0]
    if origin is None:
        origin, _ = one.malformed[0]
    cid = getattr(msg, "completion_id", None)
    eid = str(msg.event_id) if hasattr(msg, "event_id") else None
    row = ingest.dead_letter_row(
        origin, "rejected", f"database refused it: {error}", now, completion_id=cid, event_id=eid
    )
    try:
        with engine.begin() as conn:
            n = len(ingest.insert_new(conn, db.dead_letters, [row], returning=db.dead_letters.c.id))
    except Exception as e:
        if database_unavailable(e):
            raise
        # Not even its raw bytes can be stored: keep where it is in Kafka and why.
        row |= dict(
            payload=None, error=ingest.storable_text(f"{row['error']}; its bytes were refused too: {first_line(e)}")
        )
        with engine.begin() as conn:
            n = len(ingest.insert_new(conn, db.dead_letters, [row], returning=db.dead_letters.c.id))
    return Counts(dead_letters={"rejected": n} if n else {})


def _commit(consumer, records: list) -> None:
    from kafka import TopicPartition
    from kafka.errors import KafkaError
    from kafka.structs import OffsetAndMetadata

    last: dict[TopicPartition, int] = {}
    for r in records:
        tp = TopicPartition(r.topic, r.partition)
        last[tp] = max(last.get(tp, -1), r.offset)
    try:
        consumer.commit({tp: OffsetAndMetadata(off + 1, "", -1) for tp, off in last.items()})
    except KafkaError as e:
        # Rebalanced away or the broker is down: the rows are durable, and the next owner
        # replays these messages into the unique keys, which ignore them.
        log.warning("offset commit failed (%s); the batch will be replayed harmlessly", type(e).__name__)


def _sweep(engine, settings: SinkSettings) -> Counts:
    cfg = settings.sink
    now = datetime.now(UTC)
    counts = Counts()

    def expire() -> None:
        with engine.begin() as conn:
            if n := ingest.expire_pending(conn, now=now, grace_s=cfg.grace_period_s):
                counts.add(Counts(dead_letters={"unknown_completion": n}))

    def rewards() -> None:
        with engine.begin() as conn:
            counts.rewards = ingest.compute_due_rewards(
                conn, now=now, feedback_window_s=cfg.feedback_window_s, weights=cfg.reward
            )

    for step, run in (
        ("promotion", lambda: counts.add(_promote(engine, now))),
        ("expiry", expire),
        ("rewards", rewards),
    ):
        try:
            run()
        except Exception as e:
            if database_unavailable(e):
                DB_ERRORS.inc()
                log.warning("sweep skipped: database unavailable (%s)", first_line(e, with_type=False))
                break
            # Whatever failed stays where it is (held, due) for the next sweep; ingestion goes on.
            SWEEP_ERRORS.labels(step).inc()
            log.error("sweep step %s failed (%s); ingestion goes on", step, first_line(e))
    return counts


def _retention(engine, days: int, progress) -> None:
    from feedback.sink import retention

    try:
        with engine.begin() as conn:
            dropped = retention.apply_retention(conn, now=datetime.now(UTC), retention_days=days)
        if any(dropped.values()):
            progress(f"sink: retention dropped text older than {days} days: {retention.describe(dropped)}")
    except Exception as e:
        _retention_failed(e)


def _purge(engine, cfg: SinkSection, progress) -> None:
    from feedback.sink import retention

    try:
        with engine.begin() as conn:
            deleted = retention.delete_bookkeeping(
                conn,
                now=datetime.now(UTC),
                dead_letter_days=cfg.dead_letter_retention_days,
                dead_letter_max_rows=cfg.dead_letter_max_rows,
                pending_days=cfg.pending_retention_days,
            )
        if any(deleted.values()):
            progress(f"sink: retention deleted {retention.describe(deleted)}")
    except Exception as e:
        _retention_failed(e)


def _retention_failed(e: Exception) -> None:
    if not database_unavailable(e):
        SWEEP_ERRORS.labels("retention").inc()
        log.error("retention failed (%s); it runs again next interval", first_line(e))
        return
    log.warning("retention skipped: database unavailable (%s)", first_line(e, with_type=False))


def _record(stats: SinkStats, counts: Counts) -> None:
    stats.counts.add(counts)
    for table, n in [
        ("completions", counts.completions),
        ("events", counts.events),
        ("pending_events", counts.held),
        ("rewards", counts.rewards),
        ("inferred_events", counts.inferred),
    ]:
        if n:
            ROWS.labels(table).inc(n)
    if counts.promoted:
        ROWS.labels("events").inc(counts.promoted)
    for reason, n in counts.dead_letters.items():
        DEAD_LETTERS.labels(reason).inc(n)


def _lag(consumer) -> tuple[int | None, int]:
    """(messages between the positions and the ends of this member's partitions, how many
    partitions it holds); the lag is None while a rebalance is in progress."""
    try:
        assigned = consumer.assignment()
        total = 0
        for tp in assigned:
            high = consumer.highwater(tp)
            if high is not None:
                total += max(0, high - consumer.position(tp, timeout_ms=200))
    except Exception:  # a rebalance in progress: report no number rather than a wrong one
        return None, 0
    LAG.set(total)
    return total, len(assigned)


def _summary(s: SinkStats) -> str:
    c = s.counts
    dead = ", ".join(f"{k} {v}" for k, v in sorted(c.dead_letters.items())) or "none"
    inferred = f" (and {c.inferred} inferred)" if c.inferred else ""
    return (
        f"{c.completions} completions, {c.events + c.promoted} events{inferred}, {c.rewards} rewards, "
        f"dead letters {s.dead_letters} ({dead})"
    )


def _progress_line(now: SinkStats, before: SinkStats, dt: float) -> str:
    rows = lambda s: s.counts.completions + s.counts.events + s.counts.promoted  # noqa: E731
    rate = (rows(now) - rows(before)) / dt if dt > 0 else 0.0
    lag = "?" if now.lag is None else str(now.lag)
    # a member with no partitions is rebalancing, or idle beside as many others as partitions
    where = f"on {now.partitions} partitions" if now.partitions else "(no partitions assigned)"
    return f"sink: {rate:,.0f} rows/s, lag {lag} messages {where}; total {_summary(now)}"


def _install_signal_handlers(stop: threading.Event) -> Callable[[], None] | None:
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(signum, _frame):
        log.info("received %s: finishing the batch in hand", signal.Signals(signum).name)
        stop.set()

    for sig in previous:
        signal.signal(sig, on_signal)
    return lambda: [signal.signal(sig, h) for sig, h in previous.items()]
