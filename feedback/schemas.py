"""The messages that cross HTTP, Kafka, SQL and the learner: one typed schema each.

Each class states its invariants in its docstring and enforces them in validation, so a
message that exists at all is well-formed. On Kafka they travel as JSON (`encode` and
`decode`), keyed: completion records by `user_hash` and `filepath`, so that one partition, and
so one sink, sees a user's requests in a file in order (the sink infers feedback from each
request about the one before it: feedback/implicit.py); events by `completion_id`, so that one
completion's events stay in order; versions by `version`. An event may still overtake its
completion (they travel on different topics): the sink holds it until the record arrives.

Every integer is bounded by the SQL column that stores it (`NonNegInt32` for INTEGER columns,
`NonNegInt64` for BIGINT; feedback/db.py) and every timestamp by a sane window (`Timestamp`), on
both databases. A value SQLite or PostgreSQL cannot hold (2**63, the year 9999) would
otherwise pass validation here and then fail inside the sink; refused here, it is a 422 at
the HTTP layer and a `malformed` dead letter at the sink. The HTTP request bodies
(serving/schemas.py `EventRequest`) are meant to use these types too, so a request is
refused by its own schema with the field named, before a FeedbackEvent is built from it.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from feedback.core.clock import as_utc, utcnow
from feedback.routing import check_routing

INT32_MAX = 2**31 - 1
"""The largest value of an SQL INTEGER column (PostgreSQL's int4; SQLite stores 64 bits)."""
INT64_MAX = 2**63 - 1
"""The largest value of an SQL BIGINT column (and of any SQLite integer)."""
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
LATEST = datetime(2100, 1, 1, tzinfo=UTC)
"""Timestamps must fall in [EARLIEST, LATEST): far from both ends of Python's datetime range, so
arithmetic on them (a feedback window added, a time zone converted) cannot overflow."""

NonNegInt32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
"""A count, index or version stored in an INTEGER column: 0 <= value < 2**31."""
NonNegInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
"""A size stored in a BIGINT column: 0 <= value < 2**63."""
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
"""A vocabulary id (token, expert): stored inside JSON, read back by the learner as int32/int64."""


CURSOR_CONTEXT_CHARS = 1024
"""Characters of the file a completion record keeps on each side of the cursor (`before_cursor`,
`after_cursor`): what the next request in the same file is compared with."""


def cursor_context(prefix: str, suffix: str | None) -> tuple[str, str]:
    """The text a completion record keeps around the cursor: at most CURSOR_CONTEXT_CHARS of each side."""
    return prefix[-CURSOR_CONTEXT_CHARS:], (suffix or "")[:CURSOR_CONTEXT_CHARS]


def _sane_time(value: datetime) -> datetime:
    try:
        utc = as_utc(value)
    except OverflowError:  # an offset that moves it outside datetime's range
        raise ValueError(f"timestamp {value.isoformat()} is out of range") from None
    if not EARLIEST <= utc < LATEST:
        raise ValueError(f"timestamp {value.isoformat()} is outside {EARLIEST.year}-01-01..{LATEST.year}-01-01 (UTC)")
    return value


Timestamp = Annotated[datetime, AfterValidator(_sane_time)]
"""A datetime between EARLIEST and LATEST (a naive one is taken to be UTC, as `as_utc` does)."""

CompletionId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:\-]+$")]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
EventType = Literal["view", "select", "dismiss", "edit"]
SelectKind = Literal["full", "line", "word"]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CompletionChoice(Message):
    """One sampled continuation of a completion request.

    Invariants: `len(logprobs) == len(token_ids)`: one behaviour-policy logprob per
    completion token, as the serving engine computed it; every logprob is <= 0.
    An empty `token_ids` is the "abstain" action (immediate end of text, no suggestion).
    """

    index: NonNegInt32
    token_ids: list[TokenId]
    logprobs: list[float]
    text: str | None = None
    """Subject to the retention setting: None once dropped; token ids stay for training."""
    finish_reason: Literal["stop", "length", "abort", "withheld"] | None = None
    """"withheld": the confidence gate (model.min_confidence) kept it from the editor, which got an
    empty completion (`text` ""); `token_ids` and `logprobs` are what the engine generated. A sink
    older than this value dead-letters such a record: upgrade the sinks before the replicas."""

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> Self:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.token_ids)} completion tokens")
        if any(lp > 1e-6 for lp in self.logprobs):
            raise ValueError("logprobs must be <= 0")
        return self


class CompletionRecord(Message):
    """What the learner needs to train on a served completion (topic `flywheel.completions`).

    Invariants: `choices` is non-empty and indexed 0..n-1 in order; `model_version` is the
    version whose weights really produced every token (a request that straddles a hot swap
    is tagged with the version that served it); `user_hash` is a hash, never a raw user id;
    `routing`, when present, holds the expert ids the serving engine chose for every token it
    ran (prompt and completion but the last), per MoE layer, for the first choice: int16
    [L, P+N-1, K] in feedback.routing's compact text form, -1 where a position is unknown.
    """

    completion_id: CompletionId
    model_version: NonNegInt32
    user_hash: str = Field(max_length=128)
    session_id: str | None = Field(default=None, max_length=128)
    language: str | None = Field(default=None, max_length=64)
    filepath: str | None = Field(default=None, max_length=1024)
    prompt_token_ids: list[TokenId] = Field(min_length=1)
    choices: list[CompletionChoice] = Field(min_length=1)
    summary_ids: list[str] = []
    """Content hashes of the self-summaries that replaced older prefix chunks."""
    latency_ms: float = Field(ge=0)
    prompt_text: str | None = None
    """Subject to the retention setting (see `completion_text`)."""
    before_cursor: str | None = Field(default=None, max_length=CURSOR_CONTEXT_CHARS)
    """The end of the file's text before the cursor, as the editor sent it (`cursor_context`); None
    when not recorded. Subject to the retention setting."""
    after_cursor: str | None = Field(default=None, max_length=CURSOR_CONTEXT_CHARS)
    """The start of the file's text after the cursor (see `before_cursor`)."""
    routing: Annotated[str, AfterValidator(check_routing)] | None = None
    pinned: bool = False
    """Served for a request that named its version (`model: flywheel@vN`) instead of being routed:
    the client chose where its feedback lands, so rollout arms and the learner leave it out."""
    created_at: Timestamp = Field(default_factory=utcnow)

    @model_validator(mode="after")
    def _choices_in_order(self) -> Self:
        if [c.index for c in self.choices] != list(range(len(self.choices))):
            raise ValueError("choices must be indexed 0..n-1 in order")
        return self


class FeedbackEvent(Message):
    """One editor signal about a completion (topic `flywheel.events`), Tabby's shape plus `edit`.

    Invariants: `event_id` makes the event idempotent end to end (the client's UUID when it
    sends one, else the server's); `select_kind` is set only for `select`; `kept_text` is set
    exactly for `edit` (the text the user kept some seconds after accepting); `accepted_chars`
    counts what a `select` accepted (the whole suggestion for `full`).
    """

    event_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    completion_id: CompletionId
    type: EventType
    choice_index: NonNegInt32 = 0
    select_kind: SelectKind | None = None
    accepted_chars: NonNegInt32 | None = None
    kept_text: str | None = Field(default=None, max_length=100_000)
    view_id: str | None = Field(default=None, max_length=128)
    elapsed_ms: NonNegInt32 | None = None
    created_at: Timestamp = Field(default_factory=utcnow)

    @model_validator(mode="before")
    @classmethod
    def _select_defaults_to_full(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") == "select" and data.get("select_kind") is None:
            return {**data, "select_kind": "full"}
        return data

    @model_validator(mode="after")
    def _fields_match_type(self) -> Self:
        if self.type != "select" and self.select_kind is not None:
            raise ValueError(f"select_kind is only valid for select events, not {self.type}")
        if (self.type == "edit") != (self.kept_text is not None):
            raise ValueError("kept_text is required for edit events and only for them")
        return self


class ModelVersion(Message):
    """A published model version (topic `flywheel.versions`, table `model_versions`).

    Invariants: versions increase by publish order; a `delta` names its `parent` and
    `parent < version`; a `full` snapshot needs no parent; `sha256` is the manifest's digest;
    a version is announced only after its `STABLE` marker is written.
    """

    version: NonNegInt32
    parent: NonNegInt32 | None = None
    kind: Literal["full", "delta"]
    uri: str = Field(min_length=1)
    sha256: Sha256
    size_bytes: NonNegInt64 = 0
    full_size_bytes: NonNegInt64 = 0
    gate_passed: bool = True
    gate_reason: str | None = None
    metrics: dict[str, float] = {}
    created_at: Timestamp = Field(default_factory=utcnow)

    @model_validator(mode="after")
    def _parent_consistent(self) -> Self:
        if self.kind == "delta" and self.parent is None:
            raise ValueError("a delta version needs a parent")
        if self.parent is not None and self.parent >= self.version:
            raise ValueError(f"parent {self.parent} must be older than version {self.version}")
        return self


M = TypeVar("M", bound=Message)


class MalformedMessage(ValueError):
    """A Kafka payload that is not a valid message of the expected type."""


def encode(msg: Message) -> bytes:
    return msg.model_dump_json().encode()


def decode(cls: type[M], payload: bytes | None) -> M:
    if payload is None:
        raise MalformedMessage(f"empty {cls.__name__} payload")
    try:
        return cls.model_validate_json(payload)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise MalformedMessage(f"invalid {cls.__name__}: {where + ': ' if where else ''}{first['msg']}") from None


def key_of(msg: Message) -> bytes:
    """The Kafka key of each message type (see the module docstring)."""
    if isinstance(msg, CompletionRecord):
        # NUL cannot occur in a hex user hash: (user, file) pairs never collide.
        return f"{msg.user_hash}\x00{msg.filepath or ''}".encode("utf-8", "surrogatepass")
    if isinstance(msg, FeedbackEvent):
        return msg.completion_id.encode()
    if isinstance(msg, ModelVersion):
        return str(msg.version).encode()
    raise TypeError(f"no Kafka key for {type(msg).__name__}")


def as_dict(msg: Message) -> dict[str, Any]:
    return msg.model_dump(mode="python")
