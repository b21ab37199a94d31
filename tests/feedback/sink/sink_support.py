"""Helpers for the sink tests: private topics, a sink running in a thread, messages."""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager
from datetime import UTC, datetime

from sqlalchemy import func, select

from feedback import db
from feedback.schemas import CompletionChoice, CompletionRecord, FeedbackEvent, encode, key_of
from feedback.sink.loop import SinkSettings, SinkStats, run_sink
from tests.helpers import scaled


@contextmanager
def private_topics(kafka_settings, partitions: int = 3):
    """A fresh completions/events topic pair, so tests sharing the broker never see each other's data."""
    from kafka.admin import NewTopic

    from feedback import bus

    run = uuid.uuid4().hex[:8]
    names = (f"t-{run}.completions", f"t-{run}.events")
    client = bus.admin(kafka_settings.kafka)
    try:
        client.create_topics([NewTopic(n, num_partitions=partitions, replication_factor=1) for n in names])
        yield names
    finally:
        try:
            client.delete_topics(list(names))
        finally:
            client.close()


def sink_settings(kafka_settings, url: str, topics: tuple[str, str], **sink) -> SinkSettings:
    base = dict(
        group_id=f"t-{uuid.uuid4().hex[:8]}",
        completions_topic=topics[0],
        events_topic=topics[1],
        max_batch_wait_s=0.2,
        sweep_interval_s=0.2,
        progress_interval_s=60,
        retention_days=0,
        session_timeout_ms=6000,  # the broker's floor: a killed sink's partitions move on quickly
    )
    return SinkSettings(
        data_dir=str(kafka_settings.data_dir),
        cache_dir=str(kafka_settings.cache_dir),
        kafka=kafka_settings.kafka.model_dump(),
        database={"url": url},
        sink=base | sink,
    )


@contextmanager
def running_sink(settings: SinkSettings):
    """Run the sink in a thread; on exit stop it (finishing its batch) and re-raise what it raised."""
    stop = threading.Event()
    out: dict = {}

    def target():
        try:
            out["stats"] = run_sink(settings, stop=stop)
        except BaseException as e:  # surfaced in the test thread below
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    holder = _Result()
    try:
        yield holder
    finally:
        stop.set()
        t.join(60)
        assert not t.is_alive(), "the sink did not stop within 60s"
        if "error" in out:
            raise out["error"]
        holder.stats = out.get("stats")


class _Result:
    stats: SinkStats | None = None


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    timeout_s = scaled(timeout_s)
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})")


def count(engine, table: str, **where) -> int:
    t = db.metadata.tables[table]
    q = select(func.count()).select_from(t)
    for col, value in where.items():
        q = q.where(t.c[col] == value)
    with engine.connect() as conn:
        return conn.execute(q).scalar_one()


def completion(
    cid: str,
    text: str = "hello world",
    *,
    version: int = 1,
    language: str = "python",
    latency_ms: float = 10.0,
    created_at=None,
    **fields,
) -> CompletionRecord:
    tokens = [7] * max(1, len(text) // 2) if text else []
    return CompletionRecord(
        completion_id=cid,
        model_version=version,
        user_hash="u",
        language=language,
        prompt_token_ids=[1, 2, 3],
        choices=[CompletionChoice(index=0, token_ids=tokens, logprobs=[-0.1] * len(tokens), text=text)],
        latency_ms=latency_ms,
        prompt_text="def f():\n",
        created_at=created_at or datetime.now(UTC),
        **fields,
    )


def produce(kafka_settings, messages: list[tuple[str, object]]) -> None:
    """Send (topic, message-or-raw-bytes) pairs with acks=all, in order."""
    from feedback import bus

    p = bus.producer(kafka_settings.kafka)
    try:
        futures = []
        for topic, m in messages:
            if isinstance(m, bytes):
                futures.append(p.send(topic, key=b"junk", value=m))
            else:
                futures.append(p.send(topic, key=key_of(m), value=encode(m)))
        p.flush(30)
        for f in futures:
            f.get(timeout=scaled(30))
    finally:
        p.close()


def events_for(cid: str, *types: str) -> list[FeedbackEvent]:
    out = []
    for t in types:
        if t == "edit":
            out.append(FeedbackEvent(completion_id=cid, type="edit", kept_text="hello there"))
        elif t == "word":
            out.append(FeedbackEvent(completion_id=cid, type="select", select_kind="word", accepted_chars=5))
        else:
            out.append(FeedbackEvent(completion_id=cid, type=t))
    return out
