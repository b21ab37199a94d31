import json
import uuid

import pytest
from pydantic import ValidationError
from sqlalchemy import BigInteger, Integer

from feedback import db
from feedback.schemas import (
    CURSOR_CONTEXT_CHARS,
    INT32_MAX,
    INT64_MAX,
    CompletionChoice,
    CompletionRecord,
    FeedbackEvent,
    MalformedMessage,
    ModelVersion,
    cursor_context,
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
    # A user's requests in one file share a key (one partition: the sink sees them in order).
    assert key_of(r) == b"u\x00" and key_of(record(filepath="a.py")) == b"u\x00a.py"
    assert key_of(record(completion_id="c-2", filepath="a.py")) == key_of(record(filepath="a.py"))
    assert key_of(record(user_hash="v", filepath="a.py")) != key_of(record(filepath="a.py"))
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


# --- bounds: every integer fits its SQL column, every timestamp a sane window (finding 1a) ------

EVENT = dict(completion_id="c", type="select")
VERSION = dict(version=4, kind="full", uri="file:///w/4", sha256="a" * 64)


def _choice(**kw) -> CompletionChoice:
    return CompletionChoice(**(dict(index=0, token_ids=[5], logprobs=[-0.1]) | kw))


# (what, build a message with the value, the SQL column that stores it: feedback/db.py)
INTEGERS = [
    ("event.accepted_chars", lambda v: FeedbackEvent(**EVENT, accepted_chars=v), db.events.c.accepted_chars),
    ("event.elapsed_ms", lambda v: FeedbackEvent(**EVENT, elapsed_ms=v), db.events.c.elapsed_ms),
    ("event.choice_index", lambda v: FeedbackEvent(**EVENT, choice_index=v), db.events.c.choice_index),
    ("record.model_version", lambda v: record(model_version=v), db.completions.c.model_version),
    ("choice.index", lambda v: _choice(index=v), db.completion_choices.c.choice_index),
    ("version.version", lambda v: ModelVersion(**VERSION | {"version": v}), db.model_versions.c.version),
    ("version.size_bytes", lambda v: ModelVersion(**VERSION, size_bytes=v), db.model_versions.c.size_bytes),
    (
        "version.full_size_bytes",
        lambda v: ModelVersion(**VERSION, full_size_bytes=v),
        db.model_versions.c.full_size_bytes,
    ),
    # Inside JSON columns: vocabulary ids, which the learner reads back as machine integers.
    ("record.prompt_token_ids", lambda v: record(prompt_token_ids=[v]), None),
    ("choice.token_ids", lambda v: _choice(token_ids=[v]), None),
]


@pytest.mark.parametrize("what, build, column", INTEGERS, ids=[i[0] for i in INTEGERS])
def test_integers_are_refused_beyond_what_their_sql_column_holds(what, build, column):
    largest = INT64_MAX if column is not None and isinstance(column.type, BigInteger) else INT32_MAX
    assert column is None or isinstance(column.type, Integer)
    build(largest)  # the largest value the column holds is fine
    for too_big in (largest + 1, 2**63, 2**64):
        with pytest.raises(ValidationError, match="less than or equal"):
            build(too_big)
    with pytest.raises(ValidationError, match="greater than or equal"):
        build(-1)


def test_a_parent_version_is_bounded_like_a_version():
    assert isinstance(db.model_versions.c.parent.type, Integer)
    for too_big in (2**31, 2**63):
        with pytest.raises(ValidationError, match="less than or equal"):
            ModelVersion(**VERSION | {"version": INT32_MAX, "kind": "delta", "parent": too_big})


@pytest.mark.parametrize(
    "when",
    ["9999-12-31T23:59:59Z", "2100-01-01T00:00:00Z", "1999-12-31T23:59:59Z", "0001-01-01T00:00:00+01:00"],
)
def test_timestamps_outside_the_sane_window_are_refused(when):
    """The last one is in range as written but not once converted to UTC: it raised OverflowError
    out of validation, which is not a ValidationError, so `decode` let it through to the sink."""
    for cls, base in ((FeedbackEvent, EVENT), (CompletionRecord, json.loads(encode(record())))):
        payload = json.dumps(base | {"created_at": when}).encode()
        with pytest.raises(MalformedMessage, match="created_at"):
            decode(cls, payload)
    with pytest.raises(ValidationError, match="created_at"):
        ModelVersion(**VERSION, created_at=when)


def test_timestamps_inside_the_window_pass_naive_or_aware():
    assert FeedbackEvent(**EVENT, created_at="2026-03-01T12:00:00").created_at.year == 2026  # naive: UTC
    assert FeedbackEvent(**EVENT, created_at="2099-12-31T23:00:00-00:30").created_at.tzinfo is not None
    assert decode(FeedbackEvent, encode(FeedbackEvent(**EVENT))).completion_id == "c"  # the default: now


def test_a_malformed_message_names_the_field():
    payload = json.dumps(EVENT | {"accepted_chars": 2**63}).encode()
    with pytest.raises(MalformedMessage, match=r"^invalid FeedbackEvent: accepted_chars: Input should be less"):
        decode(FeedbackEvent, payload)


def test_a_record_with_a_malformed_routing_trace_is_refused_where_it_enters():
    from feedback.routing import encode_routing

    assert record(routing=encode_routing([[[0, 1], [-1, -1]]])).routing.startswith("1,2,2:")
    for bad in ("[[[0, 1]]]", "1,1,2:not base64!", "1,1,2:" + encode_routing([[[0, 1, 2]]]).split(":")[1]):
        with pytest.raises(ValidationError, match="routing"):
            record(routing=bad)


@pytest.mark.parametrize("n", [0, 5, CURSOR_CONTEXT_CHARS, CURSOR_CONTEXT_CHARS + 7])
def test_cursor_context_is_bounded(n):
    prefix, suffix = "p" * (n - 1) + "P", "S" + "s" * (n - 1)
    before, after = cursor_context(prefix[:n], suffix[:n])
    assert len(before) == len(after) == min(n, CURSOR_CONTEXT_CHARS)
    assert prefix[:n].endswith(before) and suffix[:n].startswith(after)
    assert cursor_context("abc", None) == ("abc", "")
    record(before_cursor=before, after_cursor=after)  # the record holds what cursor_context keeps


def test_cursor_context_over_the_bound_is_refused():
    with pytest.raises(ValidationError, match="before_cursor"):
        record(before_cursor="x" * (CURSOR_CONTEXT_CHARS + 1))
