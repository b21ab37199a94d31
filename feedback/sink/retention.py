"""Retention: the privacy control over the text users typed and were shown.

After `sink.retention_days` days these become NULL:
  - `completions.prompt_text` (the code around the cursor),
  - `completion_choices.text` (the suggestion),
  - `events.kept_text` (what the user kept after an edit),
  - `dead_letters.payload` (a raw message may hold any of the above).
Token ids (`prompt_token_ids`, `completion_choices.token_ids`), logprobs, lengths, rewards
and every other column stay: the learner trains on token ids, and the analyst views read
only the lengths. Age is measured from the record's `created_at` (`dead_at` for dead letters).
Kafka keeps its own copy for the topics' `retention.ms` (7 days by default); set it no
longer than this. The sink applies retention every `retention_interval_s`;
`flywheel retention` applies it once.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select, update
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


def describe(dropped: dict[str, int]) -> str:
    return ", ".join(f"{n} {col}" for col, n in dropped.items())
