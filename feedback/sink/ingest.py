"""What the sink does to the database: decode a batch of Kafka messages, write it, sweep.

Every write is idempotent (`INSERT ... ON CONFLICT DO NOTHING` on the unique keys, through
the SQLite or PostgreSQL insert construct), so a batch written twice (the sink crashed after
the database commit and before the offset commit) leaves the same rows as written once.
That, with offsets committed only after the database commit, makes the rows exactly once.

- Completions go to `completions` and `completion_choices`, and their reward is queued in
  `reward_due` for when the feedback window closes.
- Each new completion record is compared with the previous completion of the same user and
  file inside the feedback window (`infer_feedback`, feedback/implicit.py): whether its
  suggestion was kept becomes an event with `source = 'inferred'`, whose id is derived from the
  judged completion's id, so a replayed or redelivered record adds nothing. Where a choice has
  explicit events, its reward ignores the inferred one, whichever arrived first.
- An event whose completion is known goes to `events`. Otherwise it waits in
  `pending_events` (an event may overtake its completion record: they travel on different
  topics) until its completion arrives, or the grace period ends and it becomes a dead letter.
- A malformed message becomes a dead letter with its raw bytes, topic, partition, offset
  and the error. So does a held event whose payload no longer validates when its completion
  arrives (held by a sink whose schemas were looser): it never takes its completion down
  with it.
- What the database refuses is set aside by the caller (feedback/sink/loop.py), one
  message at a time, as a `rejected` dead letter: `reject_pending` for a held event.

Functions take the connection of a transaction the caller owns and `now` from the caller,
so that tests control time. Timestamps are stored in UTC (SQLite keeps no time zone).
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import JSON, Table, Text, and_, bindparam, cast, delete, func, select
from sqlalchemy.engine import Connection

from feedback import db
from feedback.core.clock import as_utc
from feedback.core.errors import first_line
from feedback.implicit import Judgement, judge_next
from feedback.reward import ChoiceFeedback, Event, RewardWeights, reward
from feedback.schemas import CompletionRecord, FeedbackEvent, MalformedMessage, decode, encode

CHUNK = 500  # ids per IN (...) list: far below SQLite's bound-parameter limit


class RawMessage(Protocol):
    """The part of a kafka-python ConsumerRecord the sink reads."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


@dataclass(frozen=True)
class Origin:
    """Where a message came from: enough to find it in Kafka again and to dead-letter it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    payload: bytes | None


@dataclass
class Batch:
    completions: list[tuple[CompletionRecord, Origin]] = field(default_factory=list)
    events: list[tuple[FeedbackEvent, Origin]] = field(default_factory=list)
    malformed: list[tuple[Origin, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.completions) + len(self.events) + len(self.malformed)


@dataclass
class Counts:
    """Rows a step wrote (new rows only: a duplicate counts 0)."""

    completions: int = 0
    events: int = 0
    held: int = 0
    promoted: int = 0
    dead_letters: dict[str, int] = field(default_factory=dict)
    rewards: int = 0
    inferred: int = 0

    def add(self, other: Counts) -> Counts:
        self.completions += other.completions
        self.events += other.events
        self.inferred += other.inferred
        self.held += other.held
        self.promoted += other.promoted
        self.rewards += other.rewards
        for k, v in other.dead_letters.items():
            self.dead_letters[k] = self.dead_letters.get(k, 0) + v
        return self


# --- decoding (pure) ---------------------------------------------------------------------------


def decode_batch(messages: Iterable[RawMessage], *, completions_topic: str, events_topic: str) -> Batch:
    """Sort raw messages into completions, events and malformed ones; never raises."""
    out = Batch()
    for m in messages:
        origin = Origin(m.topic, m.partition, m.offset, m.key, m.value)
        try:
            if m.topic == completions_topic:
                out.completions.append((decode(CompletionRecord, m.value), origin))
            elif m.topic == events_topic:
                out.events.append((decode(FeedbackEvent, m.value), origin))
            else:
                out.malformed.append((origin, f"unexpected topic {m.topic!r}"))
        except MalformedMessage as e:
            out.malformed.append((origin, str(e)))
        except Exception as e:  # whatever else a hostile payload provokes (deep nesting...): one message, not the sink
            out.malformed.append((origin, f"undecodable: {first_line(e)}"))
    return out


def completion_rows(rec: CompletionRecord, now: datetime) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    row = dict(
        completion_id=rec.completion_id,
        model_version=rec.model_version,
        user_hash=rec.user_hash,
        session_id=rec.session_id,
        language=rec.language,
        filepath=_storable(rec.filepath),
        prompt_token_ids=rec.prompt_token_ids,
        prompt_text=_storable(rec.prompt_text),
        before_cursor=_storable(rec.before_cursor),
        after_cursor=_storable(rec.after_cursor),
        summary_ids=rec.summary_ids,
        n_choices=len(rec.choices),
        latency_ms=rec.latency_ms,
        pinned=rec.pinned,
        created_at=as_utc(rec.created_at),
        ingested_at=now,
    )
    choices = [
        dict(
            completion_id=rec.completion_id,
            choice_index=c.index,
            token_ids=c.token_ids,
            logprobs=c.logprobs,
            # The record carries one routing trace, recorded for its first choice.
            routing=rec.routing if c.index == 0 else None,
            text=_storable(c.text),
            n_chars=len(c.text or ""),  # of the text as served
            finish_reason=c.finish_reason,
        )
        for c in rec.choices
    ]
    return row, choices


def event_row(ev: FeedbackEvent, now: datetime) -> dict[str, Any]:
    return dict(
        event_id=str(ev.event_id),
        completion_id=ev.completion_id,
        choice_index=ev.choice_index,
        type=ev.type,
        select_kind=ev.select_kind,
        accepted_chars=ev.accepted_chars,
        kept_text=_storable(ev.kept_text),
        view_id=ev.view_id,
        elapsed_ms=ev.elapsed_ms,
        created_at=as_utc(ev.created_at),
        ingested_at=now,
        source=db.EXPLICIT,
    )


def pending_row(ev: FeedbackEvent, origin: Origin, now: datetime) -> dict[str, Any]:
    return dict(
        event_id=str(ev.event_id),
        completion_id=ev.completion_id,
        payload=origin.payload if origin.payload is not None else encode(ev),
        kafka_topic=origin.topic,
        kafka_partition=origin.partition,
        kafka_offset=origin.offset,
        held_at=now,
    )


def storable_text(text: str) -> str:
    """`text` as every backend stores it: PostgreSQL text cannot hold NUL, so it is spelled out."""
    return text.replace("\x00", "\\x00")


def _storable(text: str | None) -> str | None:
    """Code and model output may hold NUL (a model can sample the byte; a file can contain it), and
    a completion that was served must reach SQL: such text is stored with NUL spelled `\\x00`, on
    every backend alike (the token ids keep the exact output). Ids and labels are not rewritten: a
    NUL there is refused by PostgreSQL and dead-lettered with the reason."""
    return None if text is None else storable_text(text)


def dead_letter_row(
    origin: Origin, reason: str, error: str, now: datetime, *, completion_id=None, event_id=None
) -> dict[str, Any]:
    # The error and the key quote what the sender wrote: made storable, so that setting a
    # message aside can never fail the way the message did.
    return dict(
        reason=reason,
        error=storable_text(error[:2000]),
        kafka_topic=origin.topic,
        kafka_partition=origin.partition,
        kafka_offset=origin.offset,
        key=storable_text(origin.key.decode(errors="backslashreplace")) if origin.key is not None else None,
        payload=origin.payload,
        completion_id=completion_id,
        event_id=event_id,
        dead_at=now,
    )


# --- writing a batch ---------------------------------------------------------------------------


def insert_new(conn: Connection, table: Table, rows: Sequence[dict[str, Any]], returning=None) -> list:
    """INSERT ... ON CONFLICT DO NOTHING; the `returning` column of the rows really inserted.

    On PostgreSQL, several rows go as one array per column (`INSERT ... SELECT FROM unnest(...)`,
    see `_unnest_insert`); elsewhere, and for a single row, as a multi-row VALUES."""
    if not rows:
        return []
    if conn.dialect.name == "postgresql" and len(rows) > 1 and all(r.keys() == rows[0].keys() for r in rows):
        stmt, as_json = _unnest_insert(table, tuple(rows[0]))
        params: Any = {n: [json.dumps(r[n]) if n in as_json else r[n] for r in rows] for n in rows[0]}
    else:
        stmt, params = db.upsert_insert(conn, table).on_conflict_do_nothing(), list(rows)
    if returning is None:
        conn.execute(stmt, params)
        return []
    return list(conn.execute(stmt.returning(returning), params).scalars())


@functools.cache
def _unnest_insert(table: Table, names: tuple[str, ...]):
    """`INSERT INTO table (names) SELECT * FROM unnest(:a::type[], :b::type[], ...) AS r(names) ON
    CONFLICT DO NOTHING` for PostgreSQL (one parameter per column, an array of its values), and the
    columns whose values travel as JSON text.

    The statement's text is the same for every batch, whatever its number of rows, so neither
    SQLAlchemy nor psycopg rebuilds it. (A multi-row VALUES holds one parameter per value, and
    psycopg re-parses its placeholders on every batch: 44% of the sink's write time at 1,000
    events a batch.) A JSON value is a list or a dict, which an array parameter would take for
    dimensions: it travels as its JSON text (`json.dumps`, SQLAlchemy's own serializer; None is
    JSON null, as in the VALUES form) and is cast back to json."""
    from sqlalchemy.dialects.postgresql import ARRAY, insert

    as_json = frozenset(n for n in names if isinstance(table.c[n].type, JSON))
    carrier = {n: Text() if n in as_json else table.c[n].type for n in names}
    arrays = (cast(bindparam(n, type_=ARRAY(carrier[n])), ARRAY(carrier[n])) for n in names)
    rows = func.unnest(*arrays).table_valued(*names).render_derived(name="r")
    picked = (cast(rows.c[n], JSON) if n in as_json else rows.c[n] for n in names)
    return insert(table).from_select(list(names), select(*picked)).on_conflict_do_nothing(), as_json


def _chunks(items: Sequence, n: int = CHUNK):
    for i in range(0, len(items), n):
        yield items[i : i + n]


def existing(conn: Connection, column, values: Iterable) -> set:
    """The subset of `values` present in `column`."""
    wanted = sorted(set(values))
    found: set = set()
    for part in _chunks(wanted):
        found.update(conn.execute(select(column).where(column.in_(part))).scalars())
    return found


def write_batch(
    conn: Connection, batch: Batch, *, now: datetime, feedback_window_s: float, promote: bool = True
) -> Counts:
    """Write one decoded batch inside the caller's transaction. `promote=False` leaves the
    events held for its new completions in `pending_events` (the caller promotes them one by
    one, so that one the database refuses cannot take a completion down with it)."""
    counts = Counts()
    new_ids = _write_completions(conn, batch.completions, now=now, feedback_window_s=feedback_window_s)
    counts.completions = len(new_ids)
    fresh = set(new_ids)
    new_records = {rec.completion_id: rec for rec, _ in batch.completions if rec.completion_id in fresh}
    counts.inferred = infer_feedback(conn, list(new_records.values()), now=now, feedback_window_s=feedback_window_s)

    known = {rec.completion_id for rec, _ in batch.completions}
    known |= existing(conn, db.completions.c.completion_id, {ev.completion_id for ev, _ in batch.events} - known)
    seen: set[str] = set()
    ready, held = [], []
    for ev, origin in batch.events:
        if str(ev.event_id) in seen:
            continue  # a retry inside the same batch
        seen.add(str(ev.event_id))
        (ready if ev.completion_id in known else held).append((ev, origin))

    inserted = insert_new(conn, db.events, [event_row(ev, now) for ev, _ in ready], returning=db.events.c.completion_id)
    counts.events = len(inserted)
    _requeue_rewarded(conn, inserted, now=now)
    counts.held = len(
        insert_new(
            conn, db.pending_events, [pending_row(ev, o, now) for ev, o in held], returning=db.pending_events.c.event_id
        )
    )
    if promote:
        promoted = promote_pending(conn, completion_ids=new_ids, now=now)
        counts.promoted = promoted.promoted
        counts.add(Counts(dead_letters=promoted.dead_letters))

    dead = [dead_letter_row(o, "malformed", err, now) for o, err in batch.malformed]
    if n := len(insert_new(conn, db.dead_letters, dead, returning=db.dead_letters.c.id)):
        counts.dead_letters["malformed"] = counts.dead_letters.get("malformed", 0) + n
    return counts


def _write_completions(conn: Connection, items, *, now: datetime, feedback_window_s: float) -> list[str]:
    rows, choices, due = [], [], []
    seen: set[str] = set()
    for rec, _ in items:
        if rec.completion_id in seen:
            continue
        seen.add(rec.completion_id)
        row, ch = completion_rows(rec, now)
        rows.append(row)
        choices += ch
        due.append(
            dict(completion_id=rec.completion_id, due_at=row["created_at"] + timedelta(seconds=feedback_window_s))
        )
    new_ids = insert_new(conn, db.completions, rows, returning=db.completions.c.completion_id)
    # A duplicate record's choices are already there; ON CONFLICT keeps the first copy.
    insert_new(conn, db.completion_choices, choices)
    fresh = set(new_ids)
    insert_new(conn, db.reward_due, [d for d in due if d["completion_id"] in fresh])
    return new_ids


def _requeue_rewarded(conn: Connection, completion_ids: Iterable[str], *, now: datetime) -> None:
    """A new event for a completion already rewarded (the sink lagged behind the window): recompute."""
    rewarded = existing(conn, db.rewards.c.completion_id, completion_ids)
    insert_new(conn, db.reward_due, [dict(completion_id=cid, due_at=now) for cid in sorted(rewarded)])


# --- implicit feedback -------------------------------------------------------------------------

INFERRED_EVENT_NAMESPACE = uuid.UUID("6f1c1f0e-3b8a-4c55-9a59-2d1f7f5f0a17")
"""uuid5 namespace of inferred events: one id per judged completion, on every sink and replay."""


def inferred_event_id(completion_id: str) -> str:
    return str(uuid.uuid5(INFERRED_EVENT_NAMESPACE, completion_id))


@dataclass(frozen=True)
class Served:
    """A completion as the implicit judge reads it: who, which file, when, the text around its
    cursor and what choice 0 suggested (None once retention dropped it)."""

    completion_id: str
    user_hash: str
    filepath: str | None
    created_at: datetime
    id: int
    before: str | None
    after: str | None
    suggestion: str | None


def previous_pairs(served: Sequence[Served], new_ids: set[str], window_s: float) -> list[tuple[Served, Served]]:
    """(previous, next) for each completion in `new_ids`: the latest earlier completion of the same
    user and file (by created_at, then arrival) at most `window_s` before it. Pure."""
    by_file: dict[tuple[str, str | None], list[Served]] = {}
    for s in served:
        by_file.setdefault((s.user_hash, s.filepath), []).append(s)
    pairs = []
    for group in by_file.values():
        group.sort(key=lambda s: (s.created_at, s.id))
        for prev, nxt in zip(group, group[1:]):
            if nxt.completion_id in new_ids and (nxt.created_at - prev.created_at).total_seconds() <= window_s:
                pairs.append((prev, nxt))
    return pairs


def judge_pair(prev: Served, nxt: Served) -> Judgement | None:
    """The judgement of `prev`'s suggestion from `nxt`'s text; None when either lacks its text."""
    if prev.suggestion is None or prev.before is None or prev.after is None:
        return None
    if nxt.before is None or nxt.after is None:
        return None
    return judge_next(prev.suggestion, prev.before, prev.after, nxt.before, nxt.after)


def read_served(
    conn: Connection, *, user_hashes: Iterable[str], since: datetime, until: datetime, text: bool = True
) -> list[Served]:
    """The completions of `user_hashes` created in [since, until]: one query per CHUNK users.
    With `text=False` only who, which file and when (`before`, `after`, `suggestion` are None):
    a busy user has many completions in a window, and only a few of them are paired."""
    c = db.completions
    out: list[Served] = []
    for part in _chunks(sorted(set(user_hashes))):
        query = _served_query(text).where(c.c.user_hash.in_(part), c.c.created_at >= since, c.c.created_at <= until)
        out += [_served(r, text) for r in conn.execute(query)]
    return out


def with_text(conn: Connection, served: Sequence[Served]) -> dict[str, Served]:
    """`served` by completion id, with their text: one query per CHUNK completions."""
    c = db.completions
    out: dict[str, Served] = {}
    for part in _chunks(sorted({s.completion_id for s in served})):
        out |= {
            r.completion_id: _served(r, True)
            for r in conn.execute(_served_query(True).where(c.c.completion_id.in_(part)))
        }
    return out


def _served_query(text: bool):
    c, ch = db.completions, db.completion_choices
    columns = [c.c.id, c.c.completion_id, c.c.user_hash, c.c.filepath, c.c.created_at]
    if not text:
        return select(*columns)
    return select(*columns, c.c.before_cursor, c.c.after_cursor, ch.c.text).select_from(
        c.outerjoin(ch, and_(ch.c.completion_id == c.c.completion_id, ch.c.choice_index == 0))
    )


def _served(r, text: bool) -> Served:
    return Served(
        r.completion_id,
        r.user_hash,
        r.filepath,
        as_utc(r.created_at),
        r.id,
        r.before_cursor if text else None,
        r.after_cursor if text else None,
        r.text if text else None,
    )


def inferred_row(prev: Served, nxt: Served, j: Judgement, now: datetime) -> dict[str, Any]:
    """The `events` row of a judgement: a select (its kind and characters) or, not kept, a dismiss."""
    return dict(
        event_id=inferred_event_id(prev.completion_id),
        completion_id=prev.completion_id,
        choice_index=0,
        type="select" if j.outcome in ("full", "partial") else "dismiss",
        select_kind=j.select_kind,
        accepted_chars=j.accepted_chars if j.outcome in ("full", "partial") else None,
        kept_text=None,
        view_id=None,
        elapsed_ms=min(int((nxt.created_at - prev.created_at).total_seconds() * 1000), 2**31 - 1),
        created_at=nxt.created_at,
        ingested_at=now,
        source=db.INFERRED,
    )


def infer_feedback(
    conn: Connection, records: Sequence[CompletionRecord], *, now: datetime, feedback_window_s: float
) -> int:
    """Judge the previous completion of each new record's user and file from the record's text
    (feedback/implicit.py) and store the outcomes as inferred events; how many were new.

    One query per CHUNK users for the candidates (in SQL already: this batch's records were just
    written), one per CHUNK pairs for their text, and one insert, whatever the batch's size.
    Choice 0 is judged: the one an editor shows."""
    records = [r for r in records if r.before_cursor is not None]
    if not records:
        return 0
    window = timedelta(seconds=feedback_window_s)
    times = [as_utc(r.created_at) for r in records]
    served = read_served(conn, user_hashes={r.user_hash for r in records}, since=min(times) - window, until=max(times))
    rows = []
    for prev, nxt in previous_pairs(served, {r.completion_id for r in records}, feedback_window_s):
        j = judge_pair(prev, nxt)
        if j is not None and j.outcome is not None:
            rows.append(inferred_row(prev, nxt, j, now))
    inserted = insert_new(conn, db.events, rows, returning=db.events.c.completion_id)
    _requeue_rewarded(conn, inserted, now=now)
    return len(inserted)


# --- sweeps: pending events, rewards -----------------------------------------------------------


def promote_pending(
    conn: Connection,
    *,
    now: datetime,
    completion_ids: Sequence[str] | None = None,
    pending_ids: Sequence[int] | None = None,
) -> Counts:
    """Move held events whose completion has arrived into `events`: those of `completion_ids`,
    or the held rows `pending_ids`, or all of them when both are None. A held payload that no
    longer validates becomes a `malformed` dead letter instead. Returns `promoted` and those
    dead letters."""
    p, c = db.pending_events, db.completions
    out = Counts()
    if (completion_ids is not None and not completion_ids) or (pending_ids is not None and not pending_ids):
        return out
    query = select(p).join(c, c.c.completion_id == p.c.completion_id)
    if completion_ids:
        batches = [query.where(p.c.completion_id.in_(part)) for part in _chunks(list(completion_ids))]
    elif pending_ids:
        batches = [query.where(p.c.id.in_(part)) for part in _chunks(list(pending_ids))]
    else:
        batches = [query]
    for q in batches:
        found = conn.execute(q).all()
        if not found:
            continue
        rows, dead = [], []
        for r in found:
            try:
                rows.append(event_row(decode(FeedbackEvent, r.payload), now))
            except MalformedMessage as e:
                dead.append(_held_dead_letter(r, "malformed", f"held event no longer valid: {e}", now))
        inserted = insert_new(conn, db.events, rows, returning=db.events.c.completion_id)
        _requeue_rewarded(conn, inserted, now=now)
        if n := len(insert_new(conn, db.dead_letters, dead, returning=db.dead_letters.c.id)):
            out.dead_letters["malformed"] = out.dead_letters.get("malformed", 0) + n
        for part in _chunks([r.id for r in found]):
            conn.execute(delete(p).where(p.c.id.in_(part)))
        out.promoted += len(rows)
    return out


def promotable(conn: Connection, *, completion_ids: Sequence[str] | None = None) -> list[int]:
    """Ids of the held events whose completion has arrived (of `completion_ids`, or all)."""
    p, c = db.pending_events, db.completions
    if completion_ids is not None and not completion_ids:
        return []
    query = select(p.c.id).join(c, c.c.completion_id == p.c.completion_id).order_by(p.c.id)
    if completion_ids is None:
        return list(conn.execute(query).scalars())
    found: list[int] = []
    for part in _chunks(list(completion_ids)):
        found += conn.execute(query.where(p.c.completion_id.in_(part))).scalars()
    return found


def reject_pending(conn: Connection, pending_id: int, error: str, *, now: datetime) -> int:
    """A held event the database refused to promote becomes a `rejected` dead letter; 1 if it
    was still held (0: another sink member moved it meanwhile)."""
    p = db.pending_events
    r = conn.execute(select(p).where(p.c.id == pending_id)).one_or_none()
    if r is None:
        return 0
    row = _held_dead_letter(r, "rejected", f"database refused it: {error}", now)
    n = len(insert_new(conn, db.dead_letters, [row], returning=db.dead_letters.c.id))
    conn.execute(delete(p).where(p.c.id == pending_id))
    return n


def _held_dead_letter(r, reason: str, error: str, now: datetime) -> dict[str, Any]:
    origin = Origin(r.kafka_topic, r.kafka_partition, r.kafka_offset, r.completion_id.encode(), r.payload)
    return dead_letter_row(origin, reason, error, now, completion_id=r.completion_id, event_id=r.event_id)


def expire_pending(conn: Connection, *, now: datetime, grace_s: float) -> int:
    """Held events older than the grace period, still without a completion, become dead letters."""
    p = db.pending_events
    promote_pending(conn, now=now)  # a completion another sink member wrote meanwhile
    expired = conn.execute(
        select(p).where(p.c.held_at < now - timedelta(seconds=grace_s)).order_by(p.c.id).limit(5000)
    ).all()
    if not expired:
        return 0
    rows = [
        _held_dead_letter(
            r, "unknown_completion", f"no completion record {r.completion_id!r} arrived within {grace_s:g}s", now
        )
        for r in expired
    ]
    n = len(insert_new(conn, db.dead_letters, rows, returning=db.dead_letters.c.id))
    for part in _chunks([r.id for r in expired]):
        conn.execute(delete(p).where(p.c.id.in_(part)))
    return n


def compute_due_rewards(
    conn: Connection, *, now: datetime, feedback_window_s: float, weights: RewardWeights, limit: int = 1000
) -> int:
    """Compute and upsert the reward of every choice whose completion's feedback window has closed."""
    due_t, comp_t, ch_t, ev_t = db.reward_due, db.completions, db.completion_choices, db.events
    due = list(
        conn.execute(
            select(due_t.c.completion_id).where(due_t.c.due_at <= now).order_by(due_t.c.due_at).limit(limit)
        ).scalars()
    )
    if not due:
        return 0
    window = timedelta(seconds=feedback_window_s)
    comps = {
        r.completion_id: r
        for r in conn.execute(
            select(comp_t.c.completion_id, comp_t.c.model_version, comp_t.c.created_at).where(
                comp_t.c.completion_id.in_(due)
            )
        )
    }
    choices = conn.execute(
        select(ch_t.c.completion_id, ch_t.c.choice_index, ch_t.c.text, ch_t.c.n_chars, ch_t.c.finish_reason).where(
            ch_t.c.completion_id.in_(due)
        )
    ).all()
    # Per choice and source; an explicit event wins: the inferred ones count only without any.
    events: dict[tuple[str, int, str], list[Event]] = {}
    for e in conn.execute(
        select(
            ev_t.c.completion_id,
            ev_t.c.choice_index,
            ev_t.c.type,
            ev_t.c.select_kind,
            ev_t.c.accepted_chars,
            ev_t.c.kept_text,
            ev_t.c.created_at,
            ev_t.c.source,
        ).where(ev_t.c.completion_id.in_(due))
    ):
        comp = comps.get(e.completion_id)
        if comp is not None and as_utc(e.created_at) <= as_utc(comp.created_at) + window:
            events.setdefault((e.completion_id, e.choice_index, e.source), []).append(
                Event(e.type, e.select_kind, e.accepted_chars, e.kept_text, as_utc(e.created_at))
            )
    rows = []
    for ch in choices:
        key = (ch.completion_id, ch.choice_index)
        explicit = events.get((*key, db.EXPLICIT), ())
        inferred = () if explicit else events.get((*key, db.INFERRED), ())
        value, parts = reward(
            ChoiceFeedback(ch.n_chars, ch.text, explicit or inferred, withheld=ch.finish_reason == "withheld"), weights
        )
        if inferred:
            parts = {**parts, "source": db.INFERRED}
        rows.append(
            dict(
                completion_id=ch.completion_id,
                choice_index=ch.choice_index,
                model_version=comps[ch.completion_id].model_version,
                reward=value,
                components=parts,
                outcome=parts["outcome"],
                computed_at=now,
            )
        )
    if rows:
        stmt = db.upsert_insert(conn, db.rewards)
        stmt = stmt.on_conflict_do_update(
            index_elements=["completion_id", "choice_index"],
            set_={k: stmt.excluded[k] for k in ("model_version", "reward", "components", "outcome", "computed_at")},
        )
        conn.execute(stmt, rows)
    conn.execute(delete(due_t).where(due_t.c.completion_id.in_(due), due_t.c.due_at <= now))
    return len(rows)
