"""POST /v1/events and /v1/events/batch: what users did with completions, recorded to `flywheel.events`.

An editor sends each event as it happens (`/v1/events`, Tabby's route), or buffers a few and
sends them together (`/v1/events/batch`): one request then carries up to
serve.limits.events_per_batch events, each checked and answered on its own, so the HTTP and
authentication cost is paid once per batch instead of once per event. Events count against
the token's event rate one by one either way. An accepted event is in the ingress's buffer for
Kafka (feedback/producer.py); when that buffer is full the event is answered `unavailable` (503
for a single event) instead of being dropped after an "accepted".
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, Response
from pydantic import ValidationError

from feedback import bus
from feedback.core.auth import EditorToken
from feedback.core.web import http_limits, rate_limiter
from feedback.schemas import FeedbackEvent
from serving import metrics
from serving.http.deps import ApiState, EventsToken, StateDep
from serving.schemas import EventAccepted, EventBatchAccepted, EventBatchRequest, EventRequest, EventResult

router = APIRouter()

RETRY_FULL_BUFFER_S = 5
"""Retry-After when the buffer for Kafka is full: it drains as soon as the broker answers."""


@router.post("/v1/events", response_model=EventAccepted, responses={401: {}, 413: {}, 422: {}, 429: {}, 503: {}})
async def events(
    body: EventRequest,
    st: StateDep,
    _token: EventsToken,
    select_kind: Annotated[str | None, Query(pattern="^(full|line|word)$")] = None,
):
    """Record what the user did with a completion: view, select (full, line or word), dismiss, or edit."""
    try:
        event = to_event(body, select_kind)
    except ValueError as e:
        raise HTTPException(422, str(e).splitlines()[-1].strip()) from None
    if not st.producer.send(bus.EVENTS, event):
        raise _buffer_full()
    metrics.EVENTS.labels(event.type).inc()
    return EventAccepted(event_id=event.event_id)


@router.post(
    "/v1/events/batch", response_model=EventBatchAccepted, responses={401: {}, 413: {}, 422: {}, 429: {}, 503: {}}
)
async def events_batch(body: EventBatchRequest, st: StateDep, token: EditorToken, request: Request, response: Response):
    """Record several events at once; each is answered on its own (accepted, rejected, rate_limited, unavailable)."""
    limits = http_limits(request.app.state)
    if len(body.events) > limits.events_per_batch:
        raise HTTPException(
            422,
            f"events: {len(body.events)} events exceed the limit of {limits.events_per_batch} per batch "
            "(serve.limits.events_per_batch); send them in several batches",
        )
    results: list[EventResult] = []
    valid: list[tuple[EventResult, FeedbackEvent]] = []
    for i, item in enumerate(body.events):
        try:
            event = to_event(EventRequest.model_validate(item))
        except ValidationError as e:
            results.append(EventResult(index=i, status="rejected", error=_first_error(e)))
            continue
        except ValueError as e:
            results.append(EventResult(index=i, status="rejected", error=str(e).splitlines()[-1].strip()))
            continue
        result = EventResult(index=i, status="accepted", event_id=event.event_id)
        results.append(result)
        valid.append((result, event))
    if valid:
        # 429 (nothing recorded) when the token has no room left at all; otherwise the first
        # events that fit are recorded and the rest answered rate_limited.
        granted = rate_limiter(request.app.state).take(
            limits.events, "events", *st.tokens.holder(token), want=len(valid), what="events for this token"
        )
        _record(st, valid[:granted])
        for result, _ in valid[granted:]:
            result.status, result.event_id, result.error = "rate_limited", None, "over the token's event rate"
    counts = Counter(r.status for r in results)
    waits = [RETRY_FULL_BUFFER_S] if counts["unavailable"] else []
    if counts["rate_limited"]:
        waits.append(rate_limiter(request.app.state).retry_after(limits.events, "events", *st.tokens.holder(token)))
    if waits:  # the longer wait, so that a resend of everything left over can succeed
        response.headers["Retry-After"] = str(max(waits))
    if results and not counts["accepted"]:
        response.status_code = 503 if counts["unavailable"] else 422
    return EventBatchAccepted(
        accepted=counts["accepted"],
        rejected=counts["rejected"],
        rate_limited=counts["rate_limited"],
        unavailable=counts["unavailable"],
        results=results,
    )


def to_event(body: EventRequest, select_kind: str | None = None) -> FeedbackEvent:
    """The Kafka message of an event request (the server's event_id when the client sent none);
    ValueError when its fields contradict each other (say kept_text without `edit`)."""
    kind = body.select_kind or select_kind
    return FeedbackEvent(
        event_id=body.event_id or uuid.uuid4(),
        completion_id=body.completion_id,
        type=body.type,
        choice_index=body.choice_index,
        select_kind=kind if body.type == "select" else None,
        accepted_chars=body.accepted_chars,
        kept_text=body.kept_text,
        view_id=body.view_id,
        elapsed_ms=body.elapsed,
    )


def _record(st: ApiState, accepted: list[tuple[EventResult, FeedbackEvent]]) -> None:
    types: Counter[str] = Counter()
    for result, event in accepted:
        if st.producer.send(bus.EVENTS, event):
            types[event.type] += 1
        else:
            result.status, result.event_id = "unavailable", None
            result.error = "the server's buffer for Kafka is full; send this event again later"
    for kind, n in types.items():
        metrics.EVENTS.labels(kind).inc(n)


def _first_error(e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(x) for x in first.get("loc", ()))
    return f"{where}: {first['msg']}" if where else first["msg"]


def _buffer_full() -> HTTPException:
    return HTTPException(
        503,
        "the server's buffer for Kafka is full (is the broker up?); send the event again later",
        headers={"Retry-After": str(RETRY_FULL_BUFFER_S)},
    )
