"""Analyst views and `flywheel query` (issue 5, acceptance 4) on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from feedback import db
from feedback.core.errors import UserError
from feedback.query import (
    _plain,
    _run_postgres,
    _run_sqlite,
    check_read_only,
    explained_statement,
    planned_functions,
    run_query,
)
from feedback.reward import RewardWeights
from feedback.schemas import FeedbackEvent, encode
from feedback.sink import ingest
from feedback.sink.ingest import Batch, Origin
from tests.feedback.sink.sink_support import completion, count, events_for
from tests.helpers import flywheel, scaled

T0 = datetime(2026, 3, 1, 9, 0, tzinfo=UTC)
DAY = "2026-03-01"

# completion id -> (text, version, language, latency_ms, events)
DATA = {
    "a": ("hello world", 1, "python", 10.0, ("view", "select")),
    "b": ("hello world", 1, "python", 20.0, ("view", "word")),
    "c": ("hello world", 1, "python", 30.0, ("view", "dismiss")),
    "d": ("", 1, "python", 40.0, ()),
    "e": ("hello world", 2, "rust", 100.0, ("view",)),
    "f": ("hello world", 2, "rust", 200.0, ("view", "select", "edit")),
}


def load(url: str) -> None:
    engine = db.make_engine(url)
    db.upgrade(engine)
    comps, evs = [], []
    for i, (cid, (txt, version, lang, latency, types)) in enumerate(DATA.items()):
        comps.append(
            (
                completion(cid, txt, version=version, language=lang, latency_ms=latency, created_at=T0),
                Origin("c", 0, i, None, None),
            )
        )
        for j, e in enumerate(events_for(cid, *types)):
            e = FeedbackEvent(**(e.model_dump() | {"created_at": T0 + timedelta(seconds=1)}))
            evs.append((e, Origin("e", 0, 10 * i + j, None, encode(e))))
    with engine.begin() as conn:
        ingest.write_batch(conn, Batch(completions=comps, events=evs), now=T0, feedback_window_s=60)
        ingest.compute_due_rewards(conn, now=T0 + timedelta(minutes=2), feedback_window_s=60, weights=RewardWeights())
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request, tmp_path):
    u = f"sqlite:///{tmp_path / 'q.db'}" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    load(u)
    return u


def rows(url: str, sql: str) -> list[dict]:
    r = run_query(url, sql)
    return [{c: _plain(v) for c, v in zip(r.columns, row)} for row in r.rows]


def approx_rows(expected: list[dict]):
    return [{k: pytest.approx(v) if isinstance(v, float) else v for k, v in row.items()} for row in expected]


def test_views_give_hand_computed_numbers(url):
    assert rows(url, "SELECT * FROM v_daily_acceptance ORDER BY model_version") == approx_rows(
        [
            dict(
                day=DAY,
                model_version=1,
                language="python",
                shown=3,
                accepted=2,
                accept_rate=2 / 3,
                accepted_chars=16,
                dismissed=1,
                choices=4,
            ),
            dict(
                day=DAY,
                model_version=2,
                language="rust",
                shown=2,
                accepted=1,
                accept_rate=0.5,
                accepted_chars=11,
                dismissed=0,
                choices=2,
            ),
        ]
    )
    assert rows(url, "SELECT * FROM v_suggestion_rate ORDER BY model_version") == approx_rows(
        [
            dict(day=DAY, model_version=1, language="python", requests=4, suggested=3, suggestion_rate=0.75),
            dict(day=DAY, model_version=2, language="rust", requests=2, suggested=2, suggestion_rate=1.0),
        ]
    )
    # Nearest rank: p50 of 4 values is the 2nd, p90 the 4th (ceil(3.6)); of 2 values the 1st and the 2nd.
    assert rows(url, "SELECT * FROM v_latency ORDER BY model_version") == approx_rows(
        [
            dict(
                day=DAY, model_version=1, requests=4, mean_ms=25.0, p50_ms=20.0, p90_ms=40.0, p99_ms=40.0, max_ms=40.0
            ),
            dict(
                day=DAY,
                model_version=2,
                requests=2,
                mean_ms=150.0,
                p50_ms=100.0,
                p90_ms=200.0,
                p99_ms=200.0,
                max_ms=200.0,
            ),
        ]
    )
    v = {r["model_version"]: r for r in rows(url, "SELECT * FROM v_version_rewards")}
    word, edit = 0.75 * 5 / 11, 0.75 * 14 / 22
    assert v[1]["rewarded"] == 4 and v[1]["mean_reward"] == pytest.approx((0.75 + word - 0.25 + 0) / 4)
    assert v[1]["mean_reward_shown"] == pytest.approx((0.75 + word - 0.25) / 3)
    assert (v[1]["accepted"], v[1]["dismissed"], v[1]["no_suggestion"], v[1]["edited"], v[1]["withheld"]) == (
        2,
        1,
        1,
        0,
        0,
    )
    assert v[2]["mean_reward"] == pytest.approx((-0.25 + edit) / 2) and (v[2]["ignored"], v[2]["edited"]) == (1, 1)


def test_version_rewards_count_withheld_suggestions_apart_from_the_shown(url):
    """The confidence gate's withheld choices (finish_reason "withheld", reward 0) are not shown:
    they stay out of mean_reward_shown and have a column of their own (migration 0007)."""
    from feedback.schemas import CompletionChoice

    c = completion("w", "", version=1, created_at=T0)
    c = c.model_copy(
        update={
            "choices": [CompletionChoice(index=0, token_ids=[5], logprobs=[-3.0], text="", finish_reason="withheld")]
        }
    )
    engine = db.make_engine(url)
    with engine.begin() as conn:
        ingest.write_batch(conn, Batch(completions=[(c, Origin("c", 0, 99, None, None))]), now=T0, feedback_window_s=60)
        ingest.compute_due_rewards(conn, now=T0 + timedelta(minutes=2), feedback_window_s=60, weights=RewardWeights())
    engine.dispose()
    v1 = {r["model_version"]: r for r in rows(url, "SELECT * FROM v_version_rewards")}[1]
    word = 0.75 * 5 / 11
    assert (v1["rewarded"], v1["withheld"], v1["no_suggestion"]) == (5, 1, 1)
    assert v1["mean_reward_shown"] == pytest.approx((0.75 + word - 0.25) / 3)  # as before the withheld one


def test_cli_query_answers_from_daily_acceptance(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    load(url)
    env = {"FLYWHEEL_DATABASE__URL": url}
    sql = "SELECT model_version, language, shown, accepted, accept_rate FROM v_daily_acceptance ORDER BY model_version"
    r = flywheel("query", sql, "--format", "json", env=env, tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert [(g["model_version"], g["shown"], g["accepted"]) for g in got] == [(1, 3, 2), (2, 2, 1)]
    r = flywheel("query", sql, "--format", "csv", env=env, tmp_path=tmp_path)
    assert r.stdout.splitlines()[0] == "model_version,language,shown,accepted,accept_rate"
    assert r.stdout.splitlines()[1].startswith("1,python,3,2,0.666")
    r = flywheel("query", sql, env=env, tmp_path=tmp_path)
    assert r.returncode == 0 and "python" in r.stdout and "2 rows" in r.stdout


WRITES = [
    "INSERT INTO events (event_id, completion_id, choice_index, type, created_at, ingested_at) VALUES ('x', 'a', 0, 'view', '2026-01-01', '2026-01-01')",
    "UPDATE completions SET model_version = 9",
    "delete from events",
    "DROP TABLE events",
    "CREATE TABLE t (x int)",
    "ALTER TABLE events ADD COLUMN x int",
    "DROP VIEW v_daily_acceptance",
    "WITH x AS (SELECT 1) DELETE FROM events",
    "SELECT 1; DELETE FROM events",
    "PRAGMA query_only = OFF",
    "ATTACH DATABASE 'other.db' AS o",
    "TRUNCATE events",
    "GRANT SELECT ON events TO PUBLIC",
    "VACUUM",
]


@pytest.fixture(scope="module")
def loaded_sqlite(tmp_path_factory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('ro') / 'ro.db'}"
    load(url)
    return url


def _unchanged(url: str) -> bool:
    engine = db.make_engine(url)
    try:
        return count(engine, "events") == 10 and count(engine, "completions") == 6
    finally:
        engine.dispose()


@pytest.mark.parametrize("sql", WRITES)
def test_query_refuses_writes_and_ddl(loaded_sqlite, sql):
    with pytest.raises(UserError, match="^refused"):
        run_query(loaded_sqlite, sql)
    assert _unchanged(loaded_sqlite)


@pytest.mark.parametrize("sql", [WRITES[0], WRITES[1], WRITES[2], WRITES[3], WRITES[4]])
def test_cli_query_refuses_with_one_line_and_exit_1(loaded_sqlite, tmp_path, sql):
    r = flywheel("query", sql, env={"FLYWHEEL_DATABASE__URL": loaded_sqlite}, tmp_path=tmp_path)
    assert r.returncode == 1
    assert r.stderr.startswith("flywheel: error: refused") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert _unchanged(loaded_sqlite)


def test_read_only_check_ignores_strings_and_identifiers():
    check_read_only("SELECT * FROM events WHERE type = 'delete' -- update later\n")
    check_read_only('SELECT created_at, "drop" FROM v_daily_acceptance;')
    check_read_only("WITH t AS (SELECT 1) SELECT replace('a', 'a', 'b') FROM t")
    with pytest.raises(UserError, match="read-only"):
        check_read_only("SELECT 1 FROM events FOR UPDATE")


def test_the_database_refuses_writes_the_precheck_missed(url):
    """Layers 2 and 3: without the keyword check, the connection itself is read-only."""
    write = "INSERT INTO dead_letters (reason, error, kafka_topic, kafka_partition, kafka_offset, dead_at) VALUES ('x', 'x', 't', 0, 0, '2026-01-01')"
    cte = "WITH gone AS (DELETE FROM events RETURNING 1) SELECT count(*) FROM gone"
    if url.startswith("sqlite"):
        path = make_url(url).database
        for sql in (write, "WITH x AS (SELECT 1) DELETE FROM events"):
            with pytest.raises(UserError, match="refused: flywheel query is read-only"):
                _run_sqlite(path, sql)
        with pytest.raises(UserError, match="one statement"):
            _run_sqlite(path, "SELECT 1; DELETE FROM events")
    else:
        for sql in (write, cte):
            with pytest.raises(UserError, match="refused: flywheel query is read-only"):
                _run_postgres(url, sql, role="", timeout_s=scaled(10))
        with pytest.raises(UserError, match="multiple commands"):
            _run_postgres(url, "SELECT 1; DELETE FROM events", role="", timeout_s=scaled(10))
    engine = db.make_engine(url)
    assert count(engine, "events") == 10 and count(engine, "dead_letters") == 0
    engine.dispose()


@pytest.mark.postgres
def test_analyst_role_reads_but_cannot_write(postgres_url):
    load(postgres_url)
    login = f"fw_analyst_{uuid.uuid4().hex[:8]}"
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE ROLE {login} LOGIN PASSWORD 'analyst-test' IN ROLE flywheel_analyst"))
    as_analyst = (
        make_url(postgres_url).set(username=login, password="analyst-test").render_as_string(hide_password=False)
    )
    try:
        got = run_query(as_analyst, "SELECT SUM(shown) FROM v_daily_acceptance", role="flywheel_analyst")
        assert got.rows == [(5,)]
        # The views of implicit feedback (migration 0005), and the recreated ones, are readable too.
        for view in (
            "v_choice_feedback",
            "v_choice_feedback_inferred",
            "v_daily_acceptance_inferred",
            "v_inferred_agreement",
        ):
            got = run_query(as_analyst, f"SELECT COUNT(*) FROM {view}", role="flywheel_analyst")
            assert len(got.rows) == 1, view
        analyst = create_engine(as_analyst)
        for sql in (
            "INSERT INTO rewards (completion_id, choice_index, model_version, reward, components) VALUES ('z', 0, 1, 1.0, '{}')",
            "UPDATE completions SET model_version = 9",
            "DELETE FROM events",
            "CREATE TABLE t (x int)",
        ):
            with pytest.raises(Exception, match="permission denied"), analyst.begin() as conn:
                conn.execute(text(sql))
        analyst.dispose()
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP ROLE {login}"))
        admin.dispose()


# --- the analyst connection itself refuses side effects, and queries time out (finding 5) -------

SQLITE_REFUSALS = [
    ("ATTACH DATABASE '{tmp}/created.db' AS o", "ATTACH"),  # created the file on a mode=ro connection
    ("PRAGMA query_only = OFF", "PRAGMA query_only"),
    ("PRAGMA writable_schema = ON", "PRAGMA writable_schema"),
    ("SELECT load_extension('{tmp}/evil')", "function load_extension"),
    ("BEGIN IMMEDIATE", "a transaction statement"),
    ("DETACH DATABASE main", "DETACH"),
]


@pytest.mark.parametrize("sql, what", SQLITE_REFUSALS, ids=[w for _, w in SQLITE_REFUSALS])
def test_sqlite_analyst_connection_refuses_attach_pragma_and_extensions(loaded_sqlite, tmp_path, sql, what):
    """Past the keyword check (called directly), the connection's authorizer still refuses."""
    path = make_url(loaded_sqlite).database
    with pytest.raises(UserError, match=rf"^refused: flywheel query is read-only \({what} is not allowed\)"):
        _run_sqlite(path, sql.format(tmp=tmp_path))
    assert not (tmp_path / "created.db").exists()
    assert _unchanged(loaded_sqlite)
    assert _run_sqlite(path, "SELECT COUNT(*) FROM v_choice_feedback").rows == [(6,)]  # reads still work


def test_sqlite_query_is_cancelled_after_the_statement_timeout(loaded_sqlite):
    """Before the fix SQLite had no limit: this ran to the end (10-20 s), and an unbounded one forever."""
    slow = "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r WHERE x < 100000000) SELECT COUNT(*) FROM r"
    t0 = time.perf_counter()
    with pytest.raises(UserError, match=r"^query cancelled: it ran longer than query.statement_timeout_s \(0.5s\)$"):
        run_query(loaded_sqlite, slow, statement_timeout_s=0.5)
    assert time.perf_counter() - t0 < scaled(10)


# A plain text check cannot see these: a quoted name, a schema, a filter, a string run as SQL.
PG_SIDE_EFFECTS = [
    ("SELECT pg_terminate_backend({victim})", "pg_terminate_backend"),
    ('SELECT "pg_terminate_backend"({victim})', "pg_terminate_backend"),
    ("SELECT pg_catalog.pg_advisory_lock(4242)", "pg_advisory_lock"),
    ("SELECT * FROM v_daily_acceptance WHERE pg_advisory_lock(4242) IS NOT NULL", "pg_advisory_lock"),
    ("EXPLAIN ANALYZE SELECT pg_advisory_lock(4242)", "pg_advisory_lock"),
    ("SELECT set_config('statement_timeout', '0', false)", "set_config"),
    ("WITH t AS MATERIALIZED (SELECT pg_sleep(60)) SELECT * FROM t", "pg_sleep"),
    ("SELECT query_to_xml('SELECT pg_terminate_backend({victim})', true, false, '')", "query_to_xml"),
    ("SELECT lo_create(0)", "lo_create"),
]


@pytest.mark.postgres
@pytest.mark.parametrize("sql, function", PG_SIDE_EFFECTS, ids=[s for s, _ in PG_SIDE_EFFECTS])
def test_postgres_analyst_query_refuses_side_effecting_functions(postgres_url, sql, function):
    """READ ONLY let every one of these run: a terminated session, a lock held, a setting changed."""
    import psycopg

    load(postgres_url)
    libpq = make_url(postgres_url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(libpq, autocommit=True) as victim:
        with pytest.raises(UserError, match=rf"^refused: .*side-effecting \(volatile\).* calls {function}$"):
            run_query(postgres_url, sql.format(victim=victim.info.backend_pid), statement_timeout_s=scaled(10))
        assert victim.execute("SELECT 1").fetchone() == (1,)  # not terminated
        assert victim.execute("SELECT pg_try_advisory_lock(4242)").fetchone() == (True,)  # nobody holds it
    # Harmless volatile functions (clocks, random numbers) and plain reads still run.
    got = run_query(
        postgres_url, "SELECT random() < 1, clock_timestamp() IS NOT NULL, SUM(shown) FROM v_daily_acceptance"
    )
    assert got.rows == [(True, True, 5)]


@pytest.mark.postgres
def test_postgres_query_is_cancelled_after_the_statement_timeout(postgres_url):
    load(postgres_url)
    slow = "SELECT COUNT(*) FROM generate_series(1, 10000000000::bigint)"
    t0 = time.perf_counter()
    with pytest.raises(UserError, match=r"^query cancelled: it ran longer than query.statement_timeout_s \(0.5s\)$"):
        run_query(postgres_url, slow, statement_timeout_s=0.5)
    assert time.perf_counter() - t0 < scaled(10)


def test_the_side_effect_check_reads_the_servers_plan():
    assert explained_statement("-- why\nEXPLAIN (ANALYZE, FORMAT JSON) SELECT 1") == "SELECT 1"
    assert explained_statement("explain analyze verbose WITH t AS (SELECT 1) SELECT * FROM t").startswith("WITH t")
    assert explained_statement("/* x */ SHOW work_mem") is None
    assert explained_statement("SELECT 2") == "SELECT 2"
    plan = (
        "Result\n  Output: pg_sleep('1'::double precision), 'pg_cancel_backend(1)'::text, \"Odd\"\"Name\"(1),"
        " pg_catalog.set_config('a'::text, 'b'::text, false), (x = ANY ('{1}'::integer[]))\n"
        "  ->  Function Scan on pg_catalog.generate_series g\n        Function Call: generate_series(1, 3)"
    )
    assert planned_functions(plan) == {"pg_sleep", 'Odd"Name', "set_config", "any", "generate_series"}
