"""What every HTTP route group shares besides its tokens (feedback/core/auth.py): limits on what
one client may send and how often, and request text that is valid Unicode.

    HttpLimits    the settings ([serve.limits]): body size, per-token request rates
    BodyLimit     ASGI middleware: a body over `max_body_bytes` gets 413 before any route reads,
                  parses or authenticates it (a body without Content-Length is counted as it
                  streams in, and refused the moment it passes the limit)
    RateLimiter   per-key rate limits (the `limits` library's moving window, in memory): 429
                  with Retry-After
    RequestBody   the base of request bodies: every string in it must be valid Unicode

The counts live in the memory of the process that serves the request: an API with several
ingress replicas lets each replica allow its limit, so a client spread over N replicas may
get up to N times the limit.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Annotated, Any, get_args

from fastapi import HTTPException
from limits import RateLimitItem, parse_many
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from feedback.core.config import Section


@lru_cache(maxsize=64)
def rate_items(spec: str) -> tuple[RateLimitItem, ...]:
    """The limits of a rate spec ("20/second; 600/minute"); none for an empty spec."""
    return tuple(parse_many(spec)) if spec.strip() else ()


def _rate_spec(spec: str) -> str:
    try:
        rate_items(spec)
    except ValueError:
        raise ValueError(
            f"{spec!r} is not a rate limit: write e.g. '20/second', '600 per minute' or '5 per 15 minutes', "
            "several separated by ';' (empty: no limit)"
        ) from None
    return spec


RateSpec = Annotated[str, AfterValidator(_rate_spec)]
"""Rate limits in the `limits` library's notation: "20/second; 600/minute" (each must hold);
empty: no limit."""


class HttpLimits(Section):
    """What one client may send to the API, and how often (section `[serve.limits]`)."""

    max_body_bytes: int = Field(default=4 * 2**20, ge=1024)
    """Largest request body, in bytes, on every route (the ops routes and the dashboard login
    too); a larger one gets 413 before it is parsed or its token checked. The default holds the
    largest prompt serve.max_prompt_chars allows even when every character is JSON-escaped."""
    completions: RateSpec = "20/second; 600/minute"
    """Completion requests one editor token may send (all its users together); beyond it: 429
    with Retry-After. A person typing sends a few a second at most."""
    events: RateSpec = "100/second; 3000/minute"
    """Feedback events one editor token may send, counted by event (a batch of 50 counts 50);
    beyond it: 429 with Retry-After (a client that retries later with the same event_id loses
    nothing)."""
    events_per_batch: int = Field(default=1000, ge=1, le=100_000)
    """Most events in one `POST /v1/events/batch`; a larger batch gets 422."""


def http_limits(state: Any) -> HttpLimits:
    """The app's limits (`app.state.limits`), or the defaults when the app sets none."""
    return getattr(state, "limits", None) or HttpLimits()


# --- request bodies ------------------------------------------------------------------------------


def _error_body(message: str) -> bytes:
    # ASCII JSON: a message can never fail to encode, whatever text a client put in it.
    return json.dumps({"error": {"message": message, "type": "invalid_request_error"}}, separators=(",", ":")).encode()


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body exceeds the limit of {limit} bytes (serve.limits.max_body_bytes)")


class BodyLimit:
    """ASGI middleware: refuse a request body larger than `limit(scope)` bytes with 413.

    A declared Content-Length over the limit is refused before anything is read. Otherwise the
    body is counted as the route reads it, and reading stops with 413 (raised as an
    HTTPException, which the app's handlers answer) as soon as the count passes the limit, so
    a chunked body costs at most the limit in memory."""

    def __init__(self, app, limit: Callable[[dict], int]):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit(scope)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                return await _answer(send, 400, "Content-Length must be a number of bytes")
            if int(declared) > limit:
                return await _answer(send, 413, BodyTooLarge(limit).detail)
        received = 0
        started = False

        async def counted() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def watched(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge as e:  # read outside a route (no handler saw it)
            if started:
                raise
            await _answer(send, 413, e.detail)


async def _answer(send, status: int, message: str) -> None:
    body = _error_body(message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 413:
        headers.append((b"connection", b"close"))  # the rest of the body is never read
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _valid_unicode(value: Any) -> Any:
    """`value` if every string in it (inside lists and dicts, keys too) encodes as UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"contains a lone surrogate at character {e.start}: text must be valid Unicode "
                "(a \\ud800-\\udfff escape is only valid as half of a pair)"
            ) from None
    elif isinstance(value, list | tuple):
        for v in value:
            _valid_unicode(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _valid_unicode(k)
            _valid_unicode(v)
    return value


class RequestBody(BaseModel):
    """A request body whose text is valid Unicode and whose numbers are finite.

    JSON may escape half of a surrogate pair ("\\ud800"); Python's parser turns it into a str that
    no UTF-8 encoder accepts, so it would fail later, inside Kafka's serializer, SQL or the
    tokenizer. Python's parser also takes NaN and Infinity, which JSON has not. Both are refused
    here, naming the field (422)."""

    model_config = ConfigDict(allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _text_is_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        # Before pydantic's own checks, which name only the enclosing object for some fields. A
        # field holding request bodies is left to their own check, which names the inner field.
        # Only text can be invalid Unicode: numbers, booleans and None pass at once.
        if isinstance(value, str | list | tuple | dict) and not _field_holds_bodies(cls, info.field_name):
            _valid_unicode(value)
        return value


@lru_cache(maxsize=1024)
def _field_holds_bodies(cls: type[BaseModel], field: str) -> bool:
    """Whether a field's type holds request bodies (looked up once per class and field: this runs
    for every field of every item of a batch)."""
    return _holds_bodies(cls.model_fields[field].annotation)


def _holds_bodies(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_bodies(a) for a in get_args(annotation))


# --- rate limits ---------------------------------------------------------------------------------


class RateLimiter:
    """Per-key rate limits in this process's memory: the `limits` library's moving window (a
    request counts against the limit for exactly the window after it), expired as it goes."""

    def __init__(self):
        self._limiter = MovingWindowRateLimiter(MemoryStorage())

    def hit(self, spec: str, *key: str, what: str) -> None:
        """Count one request of `key` if every limit in `spec` allows it; 429 otherwise (and
        then it is not counted, so a refused client is not held back longer)."""
        items = rate_items(spec)
        if all(self._limiter.test(item, *key) for item in items):
            for item in items:
                self._limiter.hit(item, *key)
            return
        self.refuse(spec, *key, what=what)

    def take(self, spec: str, *key: str, want: int, what: str) -> int:
        """Count up to `want` requests of `key` (a batch's items), as many as every limit of `spec`
        still allows, and return how many; 429 if not even one is allowed."""
        items = rate_items(spec)
        if want <= 0 or not items:
            return max(want, 0)
        granted = min(want, *(self._limiter.get_window_stats(item, *key).remaining for item in items))
        if granted <= 0:
            self.refuse(spec, *key, what=what)
        for item in items:
            self._limiter.hit(item, *key, cost=granted)
        return granted

    def check(self, spec: str, *key: str, what: str) -> None:
        """429 if `key` has used up a limit of `spec`; counts nothing (see `hit`)."""
        if not all(self._limiter.test(item, *key) for item in rate_items(spec)):
            self.refuse(spec, *key, what=what)

    def count(self, spec: str, *key: str) -> None:
        """Count one event of `key` (a failed login) against every limit of `spec`."""
        for item in rate_items(spec):
            self._limiter.hit(item, *key)

    def retry_after(self, spec: str, *key: str) -> int:
        """Whole seconds until `key` may send again under every limit of `spec` (at least 1)."""
        now = time.time()
        full = [i for i in rate_items(spec) if not self._limiter.test(i, *key)]
        wait = max(self._limiter.get_window_stats(i, *key).reset_time - now for i in full) if full else 1.0
        return max(1, math.ceil(wait))

    def refuse(self, spec: str, *key: str, what: str) -> None:
        full = [i for i in rate_items(spec) if not self._limiter.test(i, *key)]
        retry = self.retry_after(spec, *key)
        raise HTTPException(
            429,
            f"too many {what}: the limit is {'; '.join(str(i) for i in full)}; retry in {retry} s",
            headers={"Retry-After": str(retry)},
        )


_limiter_lock = threading.Lock()


def rate_limiter(state: Any) -> RateLimiter:
    """The app's RateLimiter (`app.state.rate_limiter`), made on first use."""
    with _limiter_lock:
        limiter = getattr(state, "rate_limiter", None)
        if limiter is None:
            limiter = state.rate_limiter = RateLimiter()
        return limiter
