"""`flywheel query "SQL"`: read-only SQL over the tables and the analyst views.

Writes are refused in three layers, the last two enforced by the database itself:
  1. a pre-check that names the problem in one line: the statement must start with SELECT,
     WITH, VALUES, TABLE, EXPLAIN or SHOW, and may not contain INSERT, UPDATE, DELETE,
     MERGE, UPSERT, REPLACE INTO, CREATE, DROP, ALTER, TRUNCATE, GRANT, REVOKE, ATTACH,
     DETACH, VACUUM, REINDEX, COPY, CALL or PRAGMA outside string literals and comments;
  2. one statement only: SQLite's driver executes one statement per call; on PostgreSQL the
     query is a server-side prepared statement, which cannot hold two;
  3. a read-only connection: SQLite opens the file with `mode=ro` and `PRAGMA query_only`;
     PostgreSQL runs the query in a READ ONLY transaction (and, with `query.role` set, as
     that role, e.g. `flywheel_analyst`), then rolls back.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from pydantic import Field

from feedback.core.config import FlywheelSettings, Section
from feedback.core.errors import UserError, first_line

READS = ("select", "with", "values", "table", "explain", "show")
WRITES = (
    "insert",
    "update",
    "delete",
    "merge",
    "upsert",
    "create",
    "drop",
    "alter",
    "truncate",
    "grant",
    "revoke",
    "attach",
    "detach",
    "vacuum",
    "reindex",
    "copy",
    "call",
    "pragma",
    "replace into",
)
# String literals, quoted identifiers and comments: what the keyword check must not look into.
_OPAQUE = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|`[^`]*`|\[[^\]]*\]|--[^\n]*|/\*.*?\*/", re.S)
_WRITE_RE = re.compile(r"\b(" + "|".join(w.replace(" ", r"\s+") for w in WRITES) + r")\b", re.I)


class QuerySection(Section):
    """Section `[query]`."""

    role: str = Field(default="", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$|^$")
    """PostgreSQL only: run queries as this role (`SET ROLE`), e.g. flywheel_analyst; the login user must be a member. Empty: the login user."""
    statement_timeout_s: float = Field(default=300.0, gt=0)
    """PostgreSQL only: cancel a query that runs longer."""


class QuerySettings(FlywheelSettings):
    """`flywheel query`."""

    query: QuerySection = QuerySection()


@dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    rows: list[tuple]


def check_read_only(sql: str) -> None:
    """Raise UserError naming the first write keyword, or a statement that is not a read."""
    visible = _OPAQUE.sub(" ", sql).strip().rstrip(";").strip()
    if not visible:
        raise UserError('empty query: pass a SELECT statement, e.g. flywheel query "SELECT * FROM v_daily_acceptance"')
    first = visible.split(None, 1)[0].lower()
    if m := _WRITE_RE.search(visible):
        word = " ".join(m.group(1).upper().split())
        raise UserError(
            f"refused: flywheel query is read-only and the query contains {word}; use SELECT (or WITH, EXPLAIN)"
        )
    if first not in READS:
        raise UserError(
            f"refused: flywheel query is read-only and runs only SELECT, WITH, VALUES, TABLE, EXPLAIN or SHOW, not {first.upper()}"
        )
    if ";" in visible:
        raise UserError("refused: one statement at a time (remove the ';' between statements)")


def run_query(url: str, sql: str, *, role: str = "", statement_timeout_s: float = 300.0) -> QueryResult:
    """Run one read-only statement against the database at `url`."""
    from sqlalchemy.engine import make_url

    check_read_only(sql)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _run_sqlite(parsed.database or "", sql)
    if parsed.get_backend_name() == "postgresql":
        return _run_postgres(url, sql, role=role, timeout_s=statement_timeout_s)
    raise UserError(f"flywheel query supports SQLite and PostgreSQL, not {parsed.get_backend_name()}")


def _run_sqlite(path: str, sql: str) -> QueryResult:
    import sqlite3
    from pathlib import Path
    from urllib.parse import quote

    file = Path(path).expanduser()
    if not path or path == ":memory:" or not file.is_file():
        raise UserError(
            f"database {path or ':memory:'} does not exist; run `flywheel up` (or `flywheel db upgrade`) first"
        )
    conn = sqlite3.connect(f"file:{quote(str(file.resolve()))}?mode=ro", uri=True, timeout=30)
    try:
        conn.execute("PRAGMA query_only = ON")
        cur = conn.execute(sql)
        columns = [d[0] for d in cur.description or []]
        return QueryResult(columns, cur.fetchall())
    except sqlite3.Error as e:
        msg = str(e)
        if "readonly" in msg or "read-only" in msg or "query_only" in msg:
            raise UserError(f"refused: flywheel query is read-only ({msg})") from None
        raise UserError(f"query failed: {msg}") from None
    finally:
        conn.close()


def _run_postgres(url: str, sql: str, *, role: str, timeout_s: float) -> QueryResult:
    import psycopg

    from feedback import db

    engine = db.make_engine(url)
    try:
        raw = engine.raw_connection()
    except Exception as e:
        raise UserError(
            f"database {engine.url.render_as_string(hide_password=True)} is unreachable: {first_line(e, with_type=False)}"
        ) from None
    try:
        pg = raw.driver_connection
        pg.rollback()  # READ ONLY must be the transaction's first statement
        with pg.cursor() as cur:
            cur.execute("SET TRANSACTION READ ONLY")
            cur.execute(f"SET LOCAL statement_timeout = {int(timeout_s * 1000)}")
            if role:
                cur.execute(f'SET LOCAL ROLE "{role}"')
            cur.execute(sql, prepare=True)  # prepared: exactly one statement
            columns = [d.name for d in cur.description or []]
            rows = cur.fetchall() if cur.description else []
        return QueryResult(columns, rows)
    except psycopg.errors.ReadOnlySqlTransaction as e:
        raise UserError(f"refused: flywheel query is read-only ({_pg_message(e)})") from None
    except psycopg.errors.InsufficientPrivilege as e:
        raise UserError(f"refused: {_pg_message(e)}") from None
    except psycopg.Error as e:
        raise UserError(f"query failed: {_pg_message(e)}") from None
    finally:
        try:
            pg.rollback()
        finally:
            raw.close()
            engine.dispose()


def _pg_message(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


# --- output ------------------------------------------------------------------------------------


def _plain(v: Any) -> Any:
    """A JSON-ready value."""
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).decode(errors="backslashreplace")
    if isinstance(v, (datetime, date)):
        return v.isoformat()
    if isinstance(v, Decimal):
        return float(v)
    return v


def _cell(v: Any) -> str:
    v = _plain(v)
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


def to_csv(r: QueryResult) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(r.columns)
    for row in r.rows:
        w.writerow(
            ["" if v is None else (json.dumps(_plain(v)) if isinstance(v, (dict, list)) else _plain(v)) for v in row]
        )
    return out.getvalue()


def to_json(r: QueryResult) -> str:
    return json.dumps([{c: _plain(v) for c, v in zip(r.columns, row)} for row in r.rows], indent=2, default=str)


def to_table(r: QueryResult):
    """A rich table; cells fold onto more lines rather than hide behind an ellipsis."""
    from rich.table import Table

    t = Table(caption=f"{len(r.rows)} row{'s' if len(r.rows) != 1 else ''}")
    for c in r.columns:
        t.add_column(c, overflow="fold")
    for row in r.rows:
        t.add_row(*[_cell(v) for v in row])
    return t


def table_width(r: QueryResult) -> int:
    """Characters the table needs to show every cell on one line."""
    widths = [len(c) for c in r.columns]
    for row in r.rows:
        widths = [max(w, len(_cell(v))) for w, v in zip(widths, row)]
    return sum(widths) + 3 * len(widths) + 1
