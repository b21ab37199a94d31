"""HTTP limits shared by every route group: the body limit on a real server, rate limits, request text."""

import socket
import time

import pytest
from fastapi import FastAPI, HTTPException, Request
from pydantic import ValidationError

from feedback.core.web import BodyLimit, HttpLimits, RateLimiter, RequestBody
from tests.helpers import scaled, uvicorn_server

LIMIT = 4096


@pytest.fixture
def server():
    """A real uvicorn server of an app behind BodyLimit whose one route reads the whole body."""
    app = FastAPI()
    app.add_middleware(BodyLimit, limit=lambda scope: LIMIT)
    app.state.read = []

    @app.post("/upload")
    async def upload(request: Request) -> dict:
        body = await request.body()
        app.state.read.append(len(body))
        return {"bytes": len(body)}

    with uvicorn_server(app) as port:
        yield port, app


def exchange(port: int, head: bytes, chunks=()) -> bytes:
    """Send `head` and `chunks` on one connection without ending the body, then read the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=scaled(10)) as s:
        s.sendall(head)
        for c in chunks:
            s.sendall(c)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            part = s.recv(65536)
            if not part:
                break
            data += part
        return data


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_sent(server):
    port, app = server
    head = f"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: {LIMIT + 1}\r\n\r\n".encode()
    answer = exchange(port, head)  # not one byte of the body was sent
    assert answer.startswith(b"HTTP/1.1 413") and b"exceeds the limit of 4096 bytes" in answer
    assert app.state.read == []


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(server):
    port, app = server
    head = b"POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"400\r\n" + b"a" * 1024 + b"\r\n"  # 1 KiB each
    # Five chunks pass the limit; the body never ends (no closing 0-chunk), so an answer means the
    # server stopped reading at the limit instead of buffering the whole body first.
    answer = exchange(port, head, [chunk] * 5)
    assert answer.startswith(b"HTTP/1.1 413") and b"serve.limits.max_body_bytes" in answer
    assert app.state.read == []


def test_a_body_within_the_limit_is_read_whole(server):
    port, app = server
    body = b"b" * LIMIT
    answer = exchange(port, f"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: {LIMIT}\r\n\r\n".encode() + body)
    assert answer.startswith(b"HTTP/1.1 200") and app.state.read == [LIMIT]


def test_rate_limit_refuses_with_retry_after_and_counts_per_key():
    limiter = RateLimiter()
    for _ in range(3):
        limiter.hit("3/second; 5/minute", "events", "token-a", what="events")
    with pytest.raises(HTTPException) as e:
        limiter.hit("3/second; 5/minute", "events", "token-a", what="events")
    assert e.value.status_code == 429 and e.value.headers["Retry-After"] == "1"
    assert "too many events: the limit is 3 per 1 second" in e.value.detail
    limiter.hit("3/second; 5/minute", "events", "token-b", what="events")  # another key has its own count
    time.sleep(1.05)  # the 1-second window has moved on; refused requests were not counted
    limiter.hit("3/second; 5/minute", "events", "token-a", what="events")
    limiter.hit("3/second; 5/minute", "events", "token-a", what="events")
    with pytest.raises(HTTPException) as e:  # now the minute's 5 are used up
        limiter.hit("3/second; 5/minute", "events", "token-a", what="events")
    assert "5 per 1 minute" in e.value.detail and 55 <= int(e.value.headers["Retry-After"]) <= 60
    limiter.hit("", "events", "token-a", what="events")  # an empty spec limits nothing


def test_check_and_count_limit_failures_only():
    limiter = RateLimiter()
    for _ in range(2):
        limiter.check("2 per 15 minutes", "login", "10.0.0.1", what="failed logins")
        limiter.count("2 per 15 minutes", "login", "10.0.0.1")
    with pytest.raises(HTTPException) as e:
        limiter.check("2 per 15 minutes", "login", "10.0.0.1", what="failed logins")
    assert e.value.status_code == 429 and 890 <= int(e.value.headers["Retry-After"]) <= 900
    limiter.check("2 per 15 minutes", "login", "10.0.0.2", what="failed logins")


def test_rate_specs_are_checked_with_the_settings():
    assert HttpLimits(completions="", events="10 per 5 seconds").events == "10 per 5 seconds"
    with pytest.raises(ValidationError, match="is not a rate limit: write e.g. '20/second'"):
        HttpLimits(completions="lots")


class Body(RequestBody):
    name: str = ""
    tags: list[str] = []
    scores: dict[str, float] = {}


@pytest.mark.parametrize(
    "data, field",
    [
        ({"name": "a\ud800b"}, "name"),
        ({"tags": ["ok", "\udfff"]}, "tags"),
        ({"scores": {"\ud800": 1.0}}, "scores"),
        ({"scores": {"x": float("nan")}}, "scores.x"),
        ({"scores": {"x": float("inf")}}, "scores.x"),
    ],
)
def test_request_bodies_refuse_lone_surrogates_and_non_finite_numbers(data, field):
    with pytest.raises(ValidationError) as e:
        Body.model_validate(data)
    assert ".".join(str(x) for x in e.value.errors()[0]["loc"]) == field
    assert Body.model_validate({"name": "caf\u00e9 \U0001f600", "tags": ["\u4e2d"]}).name.startswith("café")
