"""Time, in one convention: aware UTC in Python, UTC in the database.

SQLite hands timestamps back naive (it stores them as text without a zone); PostgreSQL
hands back aware ones. Every reader goes through `as_utc`, so the two compare alike.
"""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    """Now, aware UTC."""
    return datetime.now(UTC)


def as_utc(dt: datetime) -> datetime:
    """Aware UTC; a naive value (as SQLite returns them) is taken to be UTC already."""
    return dt.replace(tzinfo=UTC) if dt.tzinfo is None else dt.astimezone(UTC)
