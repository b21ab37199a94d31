"""A Kafka producer that never slows or fails the request that hands it a record.

`send()` only appends to a bounded in-memory buffer and returns at once. A background
thread delivers the buffer to Kafka with acks=all and retries, in order. While the broker
is down, records wait (and the thread keeps reconnecting); when it returns, they go out.
The buffer is bounded twice: in records (`max_buffered`) and in bytes (`max_buffered_bytes`,
`kafka.producer_buffer_bytes` by default), since one completion record can carry a prompt of
hundreds of kilobytes and ten thousand of them would exhaust the process's memory. When the
buffer is full, the new record is dropped, counted, and logged: never silent.

Delivery is at least once (a record whose ack was lost is sent again); the sink's unique
keys make the rows exactly once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from kafka.errors import KafkaError
from prometheus_client import Counter, Gauge

from feedback import bus
from feedback.core.config import KafkaSettings
from feedback.core.errors import UserError
from feedback.schemas import Message, encode, key_of

log = logging.getLogger(__name__)

BUFFERED = Gauge("flywheel_records_buffered", "Records waiting in the producer buffer for Kafka")
BUFFERED_BYTES = Gauge("flywheel_records_buffered_bytes", "Bytes (keys and values) waiting in the producer buffer")
DELIVERED = Counter("flywheel_records_delivered_total", "Records acknowledged by Kafka", ["topic"])
DROPPED = Counter("flywheel_records_dropped_total", "Records dropped because the producer buffer was full", ["topic"])
SEND_ERRORS = Counter("flywheel_producer_errors_total", "Failed delivery attempts (the records are retried)")


@dataclass(frozen=True)
class _Pending:
    topic: str
    key: bytes
    value: bytes

    @property
    def size(self) -> int:
        return len(self.key) + len(self.value)


class BufferedProducer:
    def __init__(
        self,
        kafka: KafkaSettings,
        *,
        max_buffered: int = 10_000,
        max_buffered_bytes: int | None = None,
        batch: int = 500,
        retry_backoff_s: float = 1.0,
    ):
        self._kafka = kafka
        self._max = max_buffered
        self._max_bytes = max_buffered_bytes or kafka.producer_buffer_bytes
        self._bytes = 0
        self._batch = batch
        self._backoff = retry_backoff_s
        self._buf: deque[_Pending] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._producer = None
        self._last_drop_log = 0.0
        self._last_refusal = ""  # logged once per distinct refusal, not at every retry
        self.delivered = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="flywheel-producer", daemon=True)
        self._thread.start()

    # --- caller side: never blocks on Kafka ---------------------------------------------------

    def send(self, topic: str, msg: Message) -> bool:
        """Queue `msg` for `topic`; False if the buffer was full and it was dropped."""
        item = _Pending(topic, key_of(msg), encode(msg))
        with self._cv:
            if len(self._buf) >= self._max or self._bytes + item.size > self._max_bytes:
                self.dropped += 1
                DROPPED.labels(topic).inc()
                self._log_drop()
                return False
            self._buf.append(item)
            self._bytes += item.size
            self._gauges()
            self._cv.notify()
        return True

    @property
    def buffered(self) -> int:
        return len(self._buf)

    @property
    def buffered_bytes(self) -> int:
        return self._bytes

    def _gauges(self) -> None:
        BUFFERED.set(len(self._buf))
        BUFFERED_BYTES.set(self._bytes)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until the buffer is empty (or `timeout_s`); True if everything was delivered."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._buf and time.monotonic() < deadline:
                self._cv.wait(0.05)
            return not self._buf

    def close(self, timeout_s: float = 10.0) -> None:
        self.flush(timeout_s)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        if self._producer is not None:
            self._producer.close(timeout=1)

    def _log_drop(self) -> None:
        now = time.monotonic()
        if now - self._last_drop_log > 10:
            self._last_drop_log = now
            log.warning(
                "producer buffer full (%d records, %d bytes; at most %d records, %d bytes): "
                "dropped %d records so far; is Kafka at %s up?",
                len(self._buf),
                self._bytes,
                self._max,
                self._max_bytes,
                self.dropped,
                self._kafka.bootstrap,
            )

    # --- delivery thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._buf and not self._closing:
                    self._cv.wait()
                if self._closing and not self._buf:
                    return
                batch = [self._buf[i] for i in range(min(self._batch, len(self._buf)))]
            if self._deliver(batch):
                with self._cv:
                    for _ in batch:  # only this thread removes, so the head is still `batch`
                        self._bytes -= self._buf.popleft().size
                    self._gauges()
                    self._cv.notify_all()
            else:
                with self._cv:
                    if self._closing:
                        return
                    self._cv.wait(self._backoff)

    def _deliver(self, batch: list[_Pending]) -> bool:
        try:
            if self._producer is None:
                self._producer = bus.producer(self._kafka, max_block_ms=5_000, bootstrap_timeout_ms=5_000)
            futures = [self._producer.send(p.topic, key=p.key, value=p.value) for p in batch]
            self._producer.flush(timeout=self._kafka.request_timeout_ms / 1000)
            for f in futures:
                f.get(timeout=0)
        except UserError as e:
            # A refused password or certificate, or a CA file not there yet: no retry fixes it,
            # but the records stay buffered (within the bounds) in case that side gets fixed.
            SEND_ERRORS.inc()
            refusal = e.kind if isinstance(e, bus.KafkaRefused) else str(e)  # logged once, not per retry
            if refusal != self._last_refusal:
                self._last_refusal = refusal
                log.error("%s; %d records stay buffered", e, len(self._buf))
            return False
        except (KafkaError, OSError) as e:
            SEND_ERRORS.inc()
            log.info("Kafka delivery failed (%s); %d records stay buffered", type(e).__name__, len(self._buf))
            if self._producer is not None:
                try:
                    self._producer.close(timeout=0)
                except (KafkaError, OSError):
                    pass
            self._producer = None
            return False
        self._last_refusal = ""
        for p in batch:
            DELIVERED.labels(p.topic).inc()
        self.delivered += len(batch)
        return True
