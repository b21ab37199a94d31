"""The HTTP front of the ingest benchmark: events POSTed to the real `/v1/events` API.

The API app (the same `build_app()` the Ray Serve ingress runs, with its real buffered
producer) serves from its own process under uvicorn, so the benchmark's clients and the
server don't share one interpreter; `send` POSTs each event from a pool of concurrent
clients, as many editors would. No model is needed: `/v1/events` never touches one.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from feedback import bus
from feedback.schemas import FeedbackEvent


class HttpEventSender:
    topic = bus.EVENTS  # where the API produces events

    def __init__(self, settings, *, concurrency: int = 16):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        token = secrets.token_urlsafe(16)
        env = {**os.environ, "FLYWHEEL_BENCH_TOKEN": token, "FLYWHEEL_BENCH_KAFKA": settings.kafka.model_dump_json()}
        self.server = subprocess.Popen([sys.executable, "-m", "ops.bench.ingest_http", str(port)], env=env)
        self.client = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
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

    def _post(self, e: FeedbackEvent) -> None:
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
        if self.client.post("/v1/events", json=body).status_code != 200:
            self.errors += 1

    def send(self, events: list[FeedbackEvent]) -> None:
        list(self.pool.map(self._post, events))

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
    # 16 clients on one token measure throughput flat out: no per-token event rate limit.
    cfg = ServeSettings(port=port, auth_tokens=[SecretStr(token)], limits={"events": ""})
    app.state.api = ApiState(cfg=cfg, replicas={}, producer=producer, editor_tokens={token}, decode=str)
    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    finally:
        producer.close(timeout_s=60)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
