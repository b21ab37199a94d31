"""The `Server-Timing` stages Flywheel's API reports, and how clients add them up.

The API's middleware (serving/http/timing.py) writes them; `flywheel bench serve` and the
simulated editors (ops/simulate.py) read them back. What `POST /v1/completions` reports, in
milliseconds:

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
the ingress) and the connection itself (`proxy` in `breakdown`).
"""

from __future__ import annotations

import statistics

STAGES = ("parse", "route", "hop", "prompt", "engine", "ttft", "record", "respond")
"""The stages a completion reports, in the order they happen (`ttft` lies within `engine`)."""


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
