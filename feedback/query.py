"""`flywheel query "SQL"`: read-only SQL over the tables and the analyst views.

Writes and side effects are refused in layers, all but the first enforced by the database
(or its driver) itself, so a query that slips past the keyword check still changes nothing:
  1. a pre-check that names the problem in one line: the statement must start with SELECT,
     WITH, VALUES, TABLE, EXPLAIN or SHOW, and may not contain INSERT, UPDATE, DELETE,
     MERGE, UPSERT, REPLACE INTO, CREATE, DROP, ALTER, TRUNCATE, GRANT, REVOKE, ATTACH,
     DETACH, VACUUM, REINDEX, COPY, CALL or PRAGMA outside string literals and comments;
  2. one statement only: SQLite's driver executes one statement per call; on PostgreSQL the
     query goes through the extended protocol (a prepared statement), which cannot hold two;
  3. a read-only connection. SQLite: the file opened with `mode=ro`, `PRAGMA query_only`, and
     an authorizer (`_sqlite_authorizer`) that allows reading and nothing else: no write, no
     ATTACH (which creates files even on a read-only connection), no PRAGMA (which could turn
     query_only off), no load_extension. PostgreSQL: a READ ONLY transaction (as `query.role`
     when set, e.g. `flywheel_analyst`), rolled back afterwards;
  4. no side-effecting function on PostgreSQL, where READ ONLY still lets pg_terminate_backend,
     pg_advisory_lock, set_config, lo_create or query_to_xml (which runs any SQL string) run:
     the server plans the query first (EXPLAIN VERBOSE), and a query calling any VOLATILE
     function (pg_proc.provolatile) but the harmless ones in `VOLATILE_ALLOWED` is refused;
  5. a time limit, `query.statement_timeout_s`: PostgreSQL's `statement_timeout`, and on SQLite a
     progress handler that interrupts the query once it is due.
"""

from __future__ import annotations

import csv
import io
import json
import re
import time
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
    """Cancel a query that runs longer (PostgreSQL's statement_timeout; on SQLite the query is interrupted)."""


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
        return _run_sqlite(parsed.database or "", sql, timeout_s=statement_timeout_s)
    if parsed.get_backend_name() == "postgresql":
        return _run_postgres(url, sql, role=role, timeout_s=statement_timeout_s)
    raise UserError(f"flywheel query supports SQLite and PostgreSQL, not {parsed.get_backend_name()}")


def _run_sqlite(path: str, sql: str, *, timeout_s: float = 300.0) -> QueryResult:
    import sqlite3
    from pathlib import Path
    from urllib.parse import quote

    file = Path(path).expanduser()
    if not path or path == ":memory:" or not file.is_file():
        raise UserError(
            f"database {path or ':memory:'} does not exist; run `flywheel up` (or `flywheel db upgrade`) first"
        )
    conn = sqlite3.connect(f"file:{quote(str(file.resolve()))}?mode=ro", uri=True, timeout=30)
    denied: list[str] = []
    deadline = time.monotonic() + timeout_s
    timed_out = False

    def authorize(action: int, arg1, arg2, _db, _trigger) -> int:
        verdict, what = _sqlite_authorizer(action, arg1, arg2)
        if verdict != sqlite3.SQLITE_OK:
            denied.append(what)
        return verdict

    def past_deadline() -> bool:
        nonlocal timed_out
        timed_out = time.monotonic() > deadline
        return timed_out  # true: SQLite interrupts the statement

    try:
        conn.execute("PRAGMA query_only = ON")
        conn.set_authorizer(authorize)  # after our own PRAGMA, which it would refuse
        conn.set_progress_handler(past_deadline, _SQLITE_PROGRESS_STEPS)
        cur = conn.execute(sql)
        columns = [d[0] for d in cur.description or []]
        return QueryResult(columns, cur.fetchall())
    except sqlite3.Error as e:
        msg = str(e)
        if timed_out:
            raise UserError(_timed_out(timeout_s)) from None
        if denied:
            raise UserError(f"refused: flywheel query is read-only ({denied[0]} is not allowed)") from None
        if "readonly" in msg or "read-only" in msg or "query_only" in msg:
            raise UserError(f"refused: flywheel query is read-only ({msg})") from None
        raise UserError(f"query failed: {msg}") from None
    finally:
        conn.close()


# SQLite virtual-machine steps between two looks at the clock: ~1 ms of work, so an overrun is short.
_SQLITE_PROGRESS_STEPS = 10_000
# Functions that reach outside the database (load_extension loads code; fts3_tokenizer takes a
# pointer) or write files (readfile/writefile/edit exist in the sqlite3 shell and some builds).
_SQLITE_DENIED_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer", "writefile", "readfile", "edit"})


def _sqlite_authorizer(action: int, arg1: str | None, arg2: str | None) -> tuple[int, str]:
    """(SQLITE_OK or SQLITE_DENY, what was asked) for one step of compiling the analyst's
    statement: reading tables and views, selecting, recursive CTEs and plain functions are
    allowed, everything else (writes, DDL, ATTACH, DETACH, PRAGMA, transactions) is denied."""
    import sqlite3

    if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE):
        return sqlite3.SQLITE_OK, ""
    if action == sqlite3.SQLITE_FUNCTION:
        name = (arg2 or "").lower()
        return (sqlite3.SQLITE_DENY if name in _SQLITE_DENIED_FUNCTIONS else sqlite3.SQLITE_OK), f"function {name}"
    names = {
        sqlite3.SQLITE_ATTACH: "ATTACH",
        sqlite3.SQLITE_DETACH: "DETACH",
        sqlite3.SQLITE_PRAGMA: f"PRAGMA {arg1}",
        sqlite3.SQLITE_INSERT: f"INSERT into {arg1}",
        sqlite3.SQLITE_UPDATE: f"UPDATE of {arg1}",
        sqlite3.SQLITE_DELETE: f"DELETE from {arg1}",
        sqlite3.SQLITE_TRANSACTION: "a transaction statement",
    }
    return sqlite3.SQLITE_DENY, names.get(action, f"a statement that changes the database (SQLite action {action})")


def _timed_out(timeout_s: float) -> str:
    return f"query cancelled: it ran longer than query.statement_timeout_s ({timeout_s:g}s)"


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
            cur.execute(f"SET LOCAL statement_timeout = {max(1, int(timeout_s * 1000))}")
            if role:
                cur.execute(f'SET LOCAL ROLE "{role}"')
            _refuse_side_effects(cur, sql)
            cur.execute(sql, prepare=True)  # prepared: exactly one statement
            columns = [d.name for d in cur.description or []]
            rows = cur.fetchall() if cur.description else []
        return QueryResult(columns, rows)
    except psycopg.errors.QueryCanceled:
        raise UserError(_timed_out(timeout_s)) from None
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


VOLATILE_ALLOWED = frozenset({"random", "random_normal", "clock_timestamp", "timeofday", "gen_random_uuid"})
"""VOLATILE functions an analyst may call: they read a clock or a random source and change nothing."""

# Single-quoted literals in the server's plan (a string may spell a function call), then
# function calls: an optional schema, then the name, quoted or not, before "(".
_PLAN_LITERAL = re.compile(r"'(?:[^']|'')*'")
_PLAN_CALL = re.compile(r'(?:(?:"(?:[^"]|"")+"|[A-Za-z_][\w$]*)\.)?("(?:[^"]|"")+"|[A-Za-z_][\w$]*)\s*\(')
# A plan node that writes (ModifyTable): "Insert on public.events", also inside a CTE.
_PLAN_WRITE = re.compile(r"^[\s>-]*((?:Insert|Update|Delete|Merge) on \S+)", re.M)
# EXPLAIN and its options, before the statement they explain: `EXPLAIN (ANALYZE, ...)`, `EXPLAIN ANALYZE VERBOSE`.
_EXPLAIN = re.compile(r"explain\s*(?:\((?:[^()']|'(?:[^']|'')*')*\)\s*|(?:(?:analy[sz]e|verbose)\b\s*)*)", re.I)
_LEADING_COMMENTS = re.compile(r"(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)*", re.S)


def planned_functions(plan: str) -> set[str]:
    """Names of the functions an EXPLAIN VERBOSE plan calls (outputs, filters, function scans)."""
    names = set()
    for m in _PLAN_CALL.finditer(_PLAN_LITERAL.sub("''", plan)):
        name = m.group(1)
        names.add(name[1:-1].replace('""', '"') if name.startswith('"') else name.lower())
    return names


def explained_statement(sql: str) -> str | None:
    """The statement to plan for the side-effect check: `sql` itself, the statement an EXPLAIN
    wraps (EXPLAIN ANALYZE runs it), or None for SHOW (which calls no function)."""
    rest = sql[_LEADING_COMMENTS.match(sql).end() :]
    word = rest.split(None, 1)[0].lower() if rest.split() else ""
    if word == "show":
        return None
    if word.startswith("explain"):
        return rest[_EXPLAIN.match(rest).end() :]
    return rest


def _refuse_side_effects(cur, sql: str) -> None:
    """Refuse a query whose plan calls a VOLATILE function not in VOLATILE_ALLOWED (see the
    module docstring): READ ONLY does not stop pg_terminate_backend, pg_advisory_lock or
    set_config. The server resolves the names (quoting, schemas, views) by planning it."""
    statement = explained_statement(sql)
    if statement is None:
        return
    cur.execute(f"EXPLAIN (VERBOSE, COSTS OFF) {statement}", prepare=True)
    plan = "\n".join(row[0] for row in cur.fetchall())
    if write := _PLAN_WRITE.search(plan):  # READ ONLY would refuse it too; say so before anything else
        raise UserError(f"refused: flywheel query is read-only (the query writes: {write.group(1)})")
    names = planned_functions(plan)
    if not names:
        return
    cur.execute(
        "SELECT DISTINCT proname FROM pg_catalog.pg_proc WHERE proname = ANY(%s) AND provolatile = 'v' ORDER BY 1",
        (sorted(names),),
    )
    refused = [name for (name,) in cur.fetchall() if name not in VOLATILE_ALLOWED]
    if refused:
        raise UserError(
            f"refused: flywheel query runs no side-effecting (volatile) function, and this query calls {', '.join(refused)}"
        )


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
