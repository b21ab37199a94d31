"""Retention: the privacy control over the text users typed and were shown.

After `sink.retention_days` days these become NULL:
  - `completions.prompt_text` (the code around the cursor), and `before_cursor` and `after_cursor`
    (the file's text on each side of it, which implicit feedback reads),
  - `completion_choices.text` (the suggestion),
  - `events.kept_text` (what the user kept after an edit),
  - `dead_letters.payload` (a raw message may hold any of the above).
Token ids (`prompt_token_ids`, `completion_choices.token_ids`), logprobs, lengths, rewards
and every other column stay: the learner trains on token ids, and the analyst views read
only the lengths. Age is measured from the record's `created_at` (`dead_at` for dead letters).
Kafka keeps its own copy for the topics' `retention.ms` (7 days by default); set it no
longer than this. The sink applies retention every `retention_interval_s`;
`flywheel retention` applies it once.

The sink's bookkeeping is deleted, rows and all, by `delete_bookkeeping` (at the same interval,
whether or not text is kept): dead letters older than `sink.dead_letter_retention_days` and
beyond the newest `sink.dead_letter_max_rows`, held events older than
`sink.pending_retention_days`. Events for completions that never arrive would otherwise pile
up there until the disk is full.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, or_, select, update
from sqlalchemy.engine import Connection

from feedback import db


def apply_retention(conn: Connection, *, now: datetime, retention_days: int) -> dict[str, int]:
    """NULL the text older than `retention_days`; rows changed per column."""
    assert retention_days > 0, "retention_days=0 means keep text forever; callers skip it"
    cutoff = now - timedelta(days=retention_days)
    c, ch, ev, dl = db.completions, db.completion_choices, db.events, db.dead_letters
    old = select(c.c.completion_id).where(c.c.created_at < cutoff)
    return {
        "completions.prompt_text": conn.execute(
            update(c).where(c.c.created_at < cutoff, c.c.prompt_text.is_not(None)).values(prompt_text=None)
        ).rowcount,
        "completions.cursor_text": conn.execute(
            update(c)
            .where(c.c.created_at < cutoff, or_(c.c.before_cursor.is_not(None), c.c.after_cursor.is_not(None)))
            .values(before_cursor=None, after_cursor=None)
        ).rowcount,
        "completion_choices.text": conn.execute(
            update(ch).where(ch.c.completion_id.in_(old), ch.c.text.is_not(None)).values(text=None)
        ).rowcount,
        "events.kept_text": conn.execute(
            update(ev).where(ev.c.created_at < cutoff, ev.c.kept_text.is_not(None)).values(kept_text=None)
        ).rowcount,
        "dead_letters.payload": conn.execute(
            update(dl).where(dl.c.dead_at < cutoff, dl.c.payload.is_not(None)).values(payload=None)
        ).rowcount,
    }


def delete_bookkeeping(
    conn: Connection, *, now: datetime, dead_letter_days: int, dead_letter_max_rows: int, pending_days: int
) -> dict[str, int]:
    """Delete old dead letters and held events (0 turns each limit off); rows deleted per table."""
    dl, p = db.dead_letters, db.pending_events
    out = {"dead_letters": 0, "pending_events": 0}
    if dead_letter_days:
        cutoff = now - timedelta(days=dead_letter_days)
        out["dead_letters"] += conn.execute(delete(dl).where(dl.c.dead_at < cutoff)).rowcount
    if dead_letter_max_rows:
        # The newest `max_rows` stay: ids grow with insertion, so the oldest go first.
        newest_dropped = select(dl.c.id).order_by(dl.c.id.desc()).offset(dead_letter_max_rows).limit(1)
        if (last := conn.execute(newest_dropped).scalar()) is not None:
            out["dead_letters"] += conn.execute(delete(dl).where(dl.c.id <= last)).rowcount
    if pending_days:
        cutoff = now - timedelta(days=pending_days)
        out["pending_events"] = conn.execute(delete(p).where(p.c.held_at < cutoff)).rowcount
    return out


def describe(dropped: dict[str, int]) -> str:
    return ", ".join(f"{n} {col}" for col, n in dropped.items())
