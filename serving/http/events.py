"""POST /v1/events: what the user did with a completion, recorded to `flywheel.events`."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query

from feedback import bus
from feedback.schemas import FeedbackEvent
from serving import metrics
from serving.http.deps import EventsToken, StateDep
from serving.schemas import EventAccepted, EventRequest

router = APIRouter()


@router.post("/v1/events", response_model=EventAccepted, responses={401: {}, 413: {}, 422: {}, 429: {}})
async def events(
    body: EventRequest,
    st: StateDep,
    _token: EventsToken,
    select_kind: Annotated[str | None, Query(pattern="^(full|line|word)$")] = None,
):
    """Record what the user did with a completion: view, select (full, line or word), dismiss, or edit."""
    kind = body.select_kind or select_kind
    try:
        event = FeedbackEvent(
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
    except ValueError as e:
        raise HTTPException(422, str(e).splitlines()[-1].strip()) from None
    st.producer.send(bus.EVENTS, event)
    metrics.EVENTS.labels(event.type).inc()
    return EventAccepted(event_id=event.event_id)
