"""Alembic migrations on SQLite and PostgreSQL; unique keys that idempotency relies on."""

import os
import stat

import pytest
from sqlalchemy import insert, inspect
from sqlalchemy.exc import IntegrityError

from feedback import db
from tests.helpers import flywheel

TABLES = {"completions", "completion_choices", "events", "rewards", "model_versions", "rollouts", "rollout_steps"}


def _check_schema(url: str) -> None:
    engine = db.make_engine(url)
    db.upgrade(engine)
    db.upgrade(engine)  # twice is harmless
    assert db.current_revision(engine) == db.head_revision()
    insp = inspect(engine)
    assert set(insp.get_table_names()) >= TABLES
    uniques = {t: {tuple(u["column_names"]) for u in insp.get_unique_constraints(t)} for t in TABLES}
    assert ("completion_id",) in uniques["completions"]
    assert ("event_id",) in uniques["events"]
    assert ("completion_id", "choice_index") in uniques["rewards"]
    assert insp.get_pk_constraint("model_versions")["constrained_columns"] == ["version"]
    assert insp.get_pk_constraint("events")["name"] == "pk_events"  # naming convention applied

    row = dict(event_id="e-1", completion_id="c-1", choice_index=0, type="view", created_at=db.func.now())
    with engine.begin() as conn:
        conn.execute(insert(db.events).values(**row))
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(insert(db.events).values(**row))
    engine.dispose()


def test_migrations_on_sqlite(tmp_path):
    _check_schema(f"sqlite:///{tmp_path / 'f.db'}")


@pytest.mark.postgres
def test_migrations_on_postgres(postgres_url):
    _check_schema(postgres_url)


def test_a_new_sqlite_database_is_owner_only(tmp_path):
    old = os.umask(0o022)
    try:
        engine = db.make_engine(f"sqlite:///{tmp_path / 'data' / 'db' / 'f.db'}")
        db.upgrade(engine)
        with engine.begin() as conn:  # a write: the WAL and shared-memory files exist while it is open
            conn.execute(
                insert(db.events).values(
                    event_id="e", completion_id="c", choice_index=0, type="view", created_at=db.func.now()
                )
            )
            files = sorted((tmp_path / "data" / "db").iterdir())
            assert [p.name for p in files] == ["f.db", "f.db-shm", "f.db-wal"]
            assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}
        engine.dispose()
    finally:
        os.umask(old)
    assert {stat.S_IMODE((tmp_path / d).stat().st_mode) for d in ("data", "data/db")} == {0o700}


def test_cli_db_upgrade_default_sqlite(tmp_path):
    r = flywheel("db", "upgrade", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "migrated" in r.stdout and (tmp_path / "data" / "flywheel.db").exists()
    r = flywheel("db", "upgrade", tmp_path=tmp_path)
    assert r.returncode == 0 and "already at revision" in r.stdout


@pytest.mark.postgres
def test_cli_db_upgrade_postgres(tmp_path, postgres_url):
    r = flywheel("db", "upgrade", "--set", f"database.url={postgres_url}", tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "postgresql" in r.stdout and "***" in r.stdout  # the password is never printed
