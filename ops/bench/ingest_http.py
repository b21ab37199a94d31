"""The HTTP front of the ingest benchmark: events POSTed to the real events API.

The API app (the same `build_app()` the Ray Serve ingress runs, with its real buffered
producer) serves from its own process under uvicorn, so the benchmark's clients and the
server don't share one interpreter. `send` POSTs the events from a pool of concurrent
clients, as many editors would: `batch` events per `POST /v1/events/batch` request, or one
per `POST /v1/events` with `batch=1`. No model is needed: the events routes never touch one.
An event counts as failed when its request fails or its item is not `accepted`.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from feedback import bus
from feedback.schemas import FeedbackEvent


class HttpEventSender:
    def __init__(self, settings, *, concurrency: int = 8, batch: int = 100):
        if batch < 1:
            raise ValueError("batch must be at least 1")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.batch, self.concurrency = batch, concurrency
        self.route = "/v1/events" if batch == 1 else "/v1/events/batch"
        # The server's producer writes this run's own topic instead of flywheel.events, so that
        # nothing left there by earlier runs or a running stack reaches the benchmark's sink.
        self.topic = f"flywheel.bench-{secrets.token_hex(4)}.http-events"
        token = secrets.token_urlsafe(16)
        env = {
            **os.environ,
            "FLYWHEEL_BENCH_TOKEN": token,
            "FLYWHEEL_BENCH_KAFKA": settings.kafka.model_dump_json(),
            "FLYWHEEL_BENCH_BATCH": str(batch),
            "FLYWHEEL_BENCH_TOPIC": self.topic,
        }
        self.server = subprocess.Popen([sys.executable, "-m", "ops.bench.ingest_http", str(port)], env=env)
        self.client = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            limits=httpx.Limits(max_connections=concurrency),
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if self.client.get("/v1/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.server.poll() is not None:
                raise RuntimeError("the benchmark's API server did not start")
            time.sleep(0.2)
        self.pool = ThreadPoolExecutor(concurrency)
        self.errors = 0
        self._lock = threading.Lock()

    @property
    def chunk(self) -> int:
        """Events to hand `send` at a time: one request for every client."""
        return self.batch * self.concurrency

    def _post(self, events: list[FeedbackEvent]) -> None:
        bodies = [_body(e) for e in events]
        payload = bodies[0] if self.route == "/v1/events" else {"events": bodies}
        try:
            r = self.client.post(self.route, content=json.dumps(payload, separators=(",", ":")))
        except httpx.HTTPError:
            failed = len(events)
        else:
            if r.status_code != 200:
                failed = len(events)
            elif self.route == "/v1/events":
                failed = 0
            else:
                failed = len(events) - r.json()["accepted"]
        if failed:
            with self._lock:
                self.errors += failed

    def send(self, events: list[FeedbackEvent]) -> None:
        list(self.pool.map(self._post, [events[i : i + self.batch] for i in range(0, len(events), self.batch)]))

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()
        self.server.terminate()  # SIGTERM: uvicorn shuts down, the producer flushes on exit
        try:
            self.server.wait(60)
        except subprocess.TimeoutExpired:
            self.server.kill()


def _serve(port: int) -> None:
    """The server process: the real API app with a real buffered producer, events only."""
    import uvicorn
    from pydantic import SecretStr

    from feedback.core.config import KafkaSettings
    from feedback.producer import BufferedProducer
    from ops.routes import ops_routers
    from serving.http.app import build_app
    from serving.http.deps import ApiState
    from serving.settings import ServeSettings

    token = os.environ["FLYWHEEL_BENCH_TOKEN"]
    producer = BufferedProducer(
        KafkaSettings.model_validate(json.loads(os.environ["FLYWHEEL_BENCH_KAFKA"])), max_buffered=1_000_000
    )
    app = build_app(routers=[make() for make in ops_routers()])
    # Many clients on one token measure throughput flat out: no per-token event rate limit.
    batch = int(os.environ["FLYWHEEL_BENCH_BATCH"])
    cfg = ServeSettings(
        port=port, auth_tokens=[SecretStr(token)], limits={"events": "", "events_per_batch": max(batch, 1)}
    )
    topic = _OwnTopic(producer, os.environ["FLYWHEEL_BENCH_TOPIC"])
    app.state.api = ApiState(cfg=cfg, replicas={}, producer=topic, editor_tokens={token}, decode=str)
    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    finally:
        producer.close(timeout_s=60)


class _OwnTopic:
    """The buffered producer, with the events topic replaced by the run's own."""

    def __init__(self, producer, topic: str):
        self.producer, self.topic = producer, topic

    def send(self, topic: str, msg) -> bool:
        return self.producer.send(self.topic if topic == bus.EVENTS else topic, msg)


def _body(e: FeedbackEvent) -> dict:
    body = {
        "type": e.type,
        "completion_id": e.completion_id,
        "choice_index": e.choice_index,
        "event_id": str(e.event_id),
    }
    if e.type == "select":
        body |= {"select_kind": e.select_kind, "accepted_chars": e.accepted_chars}
    if e.type == "edit":
        body["kept_text"] = e.kept_text
    return body


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
