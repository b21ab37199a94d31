"""Where a request's time goes: the `Server-Timing` header, and the request metrics.

`RequestTiming` is the app's outermost middleware (plain ASGI: Starlette's `BaseHTTPMiddleware`
costs a task and a stream per request). It counts and times every request by route and status
(`flywheel_http_requests_total`, `flywheel_http_request_seconds`) and gives each request a
`Stages` record in `scope["state"]`. A route marks what it spent on each stage there
(`stages(request).add("hop", ms)`), and the middleware writes them, with the request's total in
this process, into the response's `Server-Timing` header (W3C Server Timing: browsers' developer
tools and `curl -i` show it) and into `flywheel_http_stage_seconds{route,stage}`.

What `POST /v1/completions` reports (serving/http/completions.py), in milliseconds:

    parse     arrival at the ingress to the route's first line: body read, JSON, validation, token
    route     the route up to the replica call: request translation, stops, the pool's pick
    hop       the replica call less the replica's own time: Ray Serve's handle, its router and
              queue, (de)serializing the request and result, both ways
    prompt    in the replica: building the prompt (template, tokenizing, self-summaries)
    engine    in the replica: vLLM, from the request's arrival to its last token
    ttft      part of `engine`: vLLM's time to the first token (queue and prefill), when reported
    record    building the completion record and handing it to the producer
    respond   the route's return to the response's first byte: serializing the response
    total     arrival at the ingress to the response's first byte (every stage above but ttft)

What a client measures beyond `total` is Ray Serve's HTTP proxy (a separate process in front of
the ingress) and the connection itself.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from serving import metrics

STAGES = ("parse", "route", "hop", "prompt", "engine", "ttft", "record", "respond")
"""The stages a completion reports, in the order they happen (`ttft` lies within `engine`)."""


class Stages:
    """One request's stage times in ms, marked by its route."""

    __slots__ = ("arrived", "ms", "returned")

    def __init__(self, arrived: float):
        self.arrived = arrived  # time.perf_counter() at the middleware
        self.ms: dict[str, float] = {}
        self.returned: float | None = None  # when the route returned its result (perf_counter)

    def add(self, stage: str, ms: float) -> None:
        self.ms[stage] = self.ms.get(stage, 0.0) + max(0.0, ms)

    def since_arrival(self) -> float:
        return (time.perf_counter() - self.arrived) * 1000

    def header(self, total_ms: float) -> str:
        return ", ".join(f"{k};dur={v:.2f}" for k, v in (*self.ms.items(), ("total", total_ms)))


def stages(request) -> Stages | None:
    """The request's stage record (None outside the middleware, as in a unit test's bare app)."""
    return request.scope.get("state", {}).get("stages")


def parse_header(value: str) -> dict[str, float]:
    """A `Server-Timing` header as {name: ms} (entries without a duration are left out)."""
    out = {}
    for entry in value.split(","):
        name, *params = (p.strip() for p in entry.split(";"))
        for p in params:
            if p.startswith("dur="):
                try:
                    out[name] = float(p[4:])
                except ValueError:
                    pass
    return out


def breakdown(timings: list[dict[str, float]], client_ms: list[float]) -> dict[str, dict[str, float]]:
    """Mean and median ms per stage over requests (their `Server-Timing` stages, or a caller's own,
    paired with `client_ms`, what the client measured), and `client`. Where a request reported its
    `total`, `proxy` is what the client measured beyond it: Ray Serve's HTTP proxy and the
    connection. Means add up (`total` is the sum of the stages but `ttft`, which lies in `engine`);
    medians do not."""
    per_stage: dict[str, list[float]] = {}
    for t, c in zip(timings, client_ms, strict=True):
        for k, v in t.items():
            per_stage.setdefault(k, []).append(v)
        if "total" in t:
            per_stage.setdefault("proxy", []).append(max(0.0, c - t["total"]))
    if client_ms:
        per_stage["client"] = list(client_ms)
    order = [*STAGES, "total", "proxy", "client"]
    return {
        k: {"mean_ms": statistics.fmean(v), "p50_ms": statistics.median(v), "n": len(v)}
        for k, v in sorted(per_stage.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
    }


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
