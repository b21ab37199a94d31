import uuid

import pytest
from pydantic import ValidationError

from feedback.schemas import (
    CompletionChoice,
    CompletionRecord,
    FeedbackEvent,
    MalformedMessage,
    ModelVersion,
    decode,
    encode,
    key_of,
)


def record(**kw) -> CompletionRecord:
    base = dict(
        completion_id="c-1",
        model_version=3,
        user_hash="u",
        prompt_token_ids=[1, 2],
        choices=[CompletionChoice(index=0, token_ids=[5, 6], logprobs=[-0.5, -0.1], text="ab")],
        latency_ms=12.5,
    )
    return CompletionRecord(**(base | kw))


def test_round_trip_and_keys():
    r = record()
    assert decode(CompletionRecord, encode(r)) == r
    assert key_of(r) == b"c-1"
    e = FeedbackEvent(completion_id="c-1", type="view")
    assert decode(FeedbackEvent, encode(e)) == e and key_of(e) == b"c-1"
    v = ModelVersion(version=4, parent=3, kind="delta", uri="file:///w/4", sha256="a" * 64)
    assert decode(ModelVersion, encode(v)) == v and key_of(v) == b"4"


def test_one_logprob_per_token():
    with pytest.raises(ValidationError, match="logprobs"):
        CompletionChoice(index=0, token_ids=[1, 2], logprobs=[-0.1])
    with pytest.raises(ValidationError, match="<= 0"):
        CompletionChoice(index=0, token_ids=[1], logprobs=[0.5])
    assert CompletionChoice(index=0, token_ids=[], logprobs=[]).token_ids == []  # abstain is legal


def test_choices_indexed_in_order():
    with pytest.raises(ValidationError, match="0..n-1"):
        record(choices=[CompletionChoice(index=1, token_ids=[], logprobs=[])])


def test_event_invariants():
    assert FeedbackEvent(completion_id="c", type="select").select_kind == "full"
    assert FeedbackEvent(completion_id="c", type="select", select_kind="word").select_kind == "word"
    with pytest.raises(ValidationError, match="select_kind"):
        FeedbackEvent(completion_id="c", type="dismiss", select_kind="line")
    with pytest.raises(ValidationError, match="kept_text"):
        FeedbackEvent(completion_id="c", type="edit")
    with pytest.raises(ValidationError, match="kept_text"):
        FeedbackEvent(completion_id="c", type="view", kept_text="x")
    given = uuid.uuid4()
    assert FeedbackEvent(event_id=given, completion_id="c", type="view").event_id == given
    assert (
        FeedbackEvent(completion_id="c", type="view").event_id != FeedbackEvent(completion_id="c", type="view").event_id
    )


def test_version_invariants():
    with pytest.raises(ValidationError, match="parent"):
        ModelVersion(version=2, kind="delta", uri="x", sha256="0" * 64)
    with pytest.raises(ValidationError, match="older"):
        ModelVersion(version=2, parent=2, kind="delta", uri="x", sha256="0" * 64)
    with pytest.raises(ValidationError):
        ModelVersion(version=2, kind="full", uri="x", sha256="not-a-digest")


@pytest.mark.parametrize(
    "payload", [None, b"", b"{not json", b'{"completion_id": "c"}', b'{"completion_id":"c","type":"view","extra":1}']
)
def test_decode_rejects_malformed(payload):
    with pytest.raises(MalformedMessage):
        decode(FeedbackEvent, payload)
