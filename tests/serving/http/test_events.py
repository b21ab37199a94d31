"""POST /v1/events/batch: each event checked, counted and answered on its own; the single-event
route and the batch answer 'unavailable' (503) instead of 'accepted' when the buffer for Kafka is full."""

import json
import uuid

from feedback import bus
from feedback.schemas import FeedbackEvent
from tests.serving.conftest import make_client

EID = "6f1c4c1e-3f4e-4f7a-9d0e-1b2c3d4e5f60"


class FullAfter:
    """A producer whose buffer holds `room` records, then refuses (as BufferedProducer does when full)."""

    def __init__(self, room: int):
        self.room, self.sent = room, []

    def send(self, topic, msg):
        if len(self.sent) >= self.room:
            return False
        self.sent.append((topic, msg))
        return True


def test_a_batch_is_answered_item_by_item_and_keeps_the_client_ids(tok):
    client, sink, _ = make_client(tok)
    batch = [
        {"type": "view", "completion_id": "cmpl-1", "event_id": EID},
        {"type": "select", "completion_id": "cmpl-1", "select_kind": "word", "accepted_chars": 3},
        {"type": "explode", "completion_id": "cmpl-1"},  # not an event type
        {"type": "edit", "completion_id": "cmpl-1"},  # an edit without its kept_text
        "not an object",
        {"type": "view", "completion_id": "cmpl-1", "view_id": "\ud800"},  # a lone surrogate
        {"type": "dismiss", "completion_id": "cmpl-2", "elapsed": 40, "unknown_field": 1},
    ]
    r = client.post(
        "/v1/events/batch", content=json.dumps({"events": batch}), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["accepted"], body["rejected"], body["rate_limited"], body["unavailable"]) == (3, 4, 0, 0)
    statuses = [x["status"] for x in body["results"]]
    assert statuses == ["accepted", "accepted", "rejected", "rejected", "rejected", "rejected", "accepted"]
    assert [x["index"] for x in body["results"]] == list(range(7))
    errors = [x["error"] for x in body["results"] if x["status"] == "rejected"]
    assert errors[0].startswith("type: ") and "kept_text" in errors[1] and "view_id: " in errors[3]
    events = [m for t, m in sink.sent if t == bus.EVENTS]
    assert all(isinstance(e, FeedbackEvent) for e in events)
    assert [e.type for e in events] == ["view", "select", "dismiss"]
    assert str(events[0].event_id) == EID and events[1].select_kind == "word" and events[2].elapsed_ms == 40
    accepted_ids = [x["event_id"] for x in body["results"] if x["status"] == "accepted"]
    assert accepted_ids == [str(e.event_id) for e in events]  # the server's ids, to resend with


def test_a_batch_of_only_bad_events_is_422_and_records_nothing(tok):
    client, sink, _ = make_client(tok)
    r = client.post("/v1/events/batch", json={"events": [{"type": "view"}, {"type": "view", "completion_id": "a b"}]})
    assert r.status_code == 422 and [x["status"] for x in r.json()["results"]] == ["rejected", "rejected"]
    assert r.json()["results"][0]["error"].startswith("completion_id: ")
    assert sink.sent == []


def test_batch_envelope_refusals(tok):
    client, sink, _ = make_client(tok, limits={"events_per_batch": 4})
    r = client.post("/v1/events/batch", json={"events": [{"type": "view", "completion_id": "c"}] * 5})
    assert r.status_code == 422 and "limit of 4 per batch" in r.json()["error"]["message"]
    for bad in ({}, {"events": "view"}, [1, 2]):
        r = client.post("/v1/events/batch", json=bad)
        assert r.status_code == 422 and r.json()["error"]["message"], bad
    r = client.post("/v1/events/batch", json={"events": []})
    assert r.status_code == 200 and r.json()["accepted"] == 0
    assert sink.sent == []


def test_a_batch_counts_against_the_event_rate_by_event(tok):
    client, sink, _ = make_client(tok, limits={"events": "5/minute"})
    view = {"type": "view", "completion_id": "c"}
    r = client.post("/v1/events/batch", json={"events": [view] * 3})
    assert r.status_code == 200 and r.json()["accepted"] == 3
    r = client.post("/v1/events/batch", json={"events": [view, {"type": "view"}, view, view]})  # 3 valid, room for 2
    body = r.json()
    assert r.status_code == 200 and [x["status"] for x in body["results"]] == [
        "accepted",
        "rejected",
        "accepted",
        "rate_limited",
    ]
    assert 1 <= int(r.headers["Retry-After"]) <= 60 and body["results"][3]["event_id"] is None
    r = client.post("/v1/events/batch", json={"events": [view]})
    assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 60
    assert client.post("/v1/events", json=view).status_code == 429  # one count for both routes
    assert len(sink.sent) == 5


def test_a_full_buffer_is_unavailable_not_accepted(tok):
    client, _, _ = make_client(tok)
    producer = client.app.state.api.producer = FullAfter(room=2)
    events = [{"type": "view", "completion_id": "c", "event_id": str(uuid.uuid4())} for _ in range(3)]
    r = client.post("/v1/events/batch", json={"events": events})
    assert r.status_code == 200 and [x["status"] for x in r.json()["results"]] == [
        "accepted",
        "accepted",
        "unavailable",
    ]
    assert r.headers["Retry-After"] == "5" and len(producer.sent) == 2
    r = client.post("/v1/events/batch", json={"events": events[2:]})
    assert r.status_code == 503 and r.json()["unavailable"] == 1
    r = client.post("/v1/events", json=events[2])
    assert r.status_code == 503 and r.headers["Retry-After"] == "5" and "buffer for Kafka is full" in r.text
