"""Fixtures of the rollout tests: a migrated database with the versions of traffic.py."""

import pytest
from sqlalchemy import text

from feedback import db
from tests.ops.rollout.traffic import record_versions


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'f.db'}" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    e = db.make_engine(url)
    db.upgrade(e)
    if request.param == "postgres":
        # An autovacuum worker (a superuser backend) in the test database would make the fixture's
        # DROP DATABASE ... WITH (FORCE) fail: these tables get thousands of rows at once.
        with e.begin() as conn:
            for table in (
                "completions",
                "completion_choices",
                "events",
                "rewards",
                "rollouts",
                "rollout_steps",
                "serving_pools",
            ):
                conn.execute(text(f"ALTER TABLE {table} SET (autovacuum_enabled = false)"))
    record_versions(e)
    yield e
    e.dispose()


@pytest.fixture
def sqlite_engine(tmp_path):
    e = db.make_engine(f"sqlite:///{tmp_path / 'f.db'}")
    db.upgrade(e)
    record_versions(e)
    yield e
    e.dispose()
