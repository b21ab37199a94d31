"""Where a request's time goes: the `Server-Timing` header, and the request metrics.

`RequestTiming` is the app's outermost middleware (plain ASGI: Starlette's `BaseHTTPMiddleware`
costs a task and a stream per request). It counts and times every request by route and status
(`flywheel_http_requests_total`, `flywheel_http_request_seconds`) and gives each request a
`Stages` record in `scope["state"]`. A route marks what it spent on each stage there
(`stages(request).add("hop", ms)`), and the middleware writes them, with the request's total in
this process, into the response's `Server-Timing` header (W3C Server Timing: browsers' developer
tools and `curl -i` show it) and into `flywheel_http_stage_seconds{route,stage}`.

The stages `POST /v1/completions` marks (serving/http/completions.py) are listed in
feedback/core/server_timing.py, beside the parser clients use to read them back.
"""

from __future__ import annotations

import time
from typing import Any

from serving import metrics


class Stages:
    """One request's stage times in ms, marked by its route."""

    __slots__ = ("arrived", "ms", "returned")

    def __init__(self, arrived: float):
        self.arrived = arrived  # time.perf_counter() at the middleware
        self.ms: dict[str, float] = {}
        self.returned: float | None = None  # when the route returned its result (perf_counter)

    def add(self, stage: str, ms: float) -> None:
        self.ms[stage] = self.ms.get(stage, 0.0) + max(0.0, ms)

    def header(self, total_ms: float) -> str:
        return ", ".join(f"{k};dur={v:.2f}" for k, v in (*self.ms.items(), ("total", total_ms)))


def stages(request) -> Stages | None:
    """The request's stage record (None outside the middleware, as in a unit test's bare app)."""
    return request.scope.get("state", {}).get("stages")


class RequestTiming:
    """ASGI middleware: request counts and latency by route and status, and `Server-Timing`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        record = Stages(t0)
        scope.setdefault("state", {})["stages"] = record
        status = 500  # an app that raises before answering

        async def timed_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if record.returned is not None:
                    record.add("respond", (time.perf_counter() - record.returned) * 1000)
                total = (time.perf_counter() - t0) * 1000
                headers = list(message.get("headers", ()))
                headers.append((b"server-timing", record.header(total).encode("ascii")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            metrics.REQUESTS.labels(path, str(status)).inc()
            metrics.LATENCY.labels(path).observe(time.perf_counter() - t0)
            for stage, ms in record.ms.items():
                metrics.STAGE_LATENCY.labels(path, stage).observe(ms / 1000)
