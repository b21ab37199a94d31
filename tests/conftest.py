"""Shared fixtures: one real Kafka broker per test session, PostgreSQL databases, settings.

The broker is the same Apache Kafka that `flywheel up` runs, started by the same code on
free ports with a throwaway data folder. The classpath comes from the user's cache (it is
fetched from Maven Central the first time).

PostgreSQL tests need `FLYWHEEL_TEST_POSTGRES_URL` (a role allowed to CREATE DATABASE);
`.ci/run` installs and starts PostgreSQL and sets it, so in CI they always run.
"""

from __future__ import annotations

import os
import sys
import time
import uuid

import pytest

from feedback.core.config import FlywheelSettings
from feedback.core.threads import prefer_passive_waiting
from tests.helpers import cpu_report, free_port, make_settings, scaled, timeout_factor

prefer_passive_waiting()  # before any test imports torch: the suite shares its cores with its own vLLM and Ray

SUITE_TIMEOUT_S = 600  # per test, before the timeout factor
_SESSION = pytest.StashKey[pytest.Session]()


def pytest_report_header(config) -> list[str]:
    return [
        cpu_report(),
        f"timeout factor {timeout_factor():g} (FLYWHEEL_TEST_TIMEOUT_FACTOR): every wait and the per-test limit scale with it",
    ]


def pytest_sessionfinish(session, exitstatus) -> None:
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """Once every report is written, exit with pytest's status without the interpreter's teardown.

    One CI run segfaulted there after its summary line said every test had passed ("1229
    passed ... Segmentation fault", exit 139): the native libraries the suite loads (vLLM, Ray,
    torch's thread pools, gRPC) keep threads that can crash while the interpreter finalizes,
    which says nothing about the tests. Ray, if a test left it running, is shut down first."""
    session = config.stash.get(_SESSION, None)
    if session is None:  # the session never ran (--help, a usage error): exit as usual
        return
    status = int(session.exitstatus)  # what pytest itself would exit with
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def pytest_collection_modifyitems(config, items) -> None:
    """pytest-timeout's limit, scaled like every other wait (a test's own `timeout` mark wins)."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(scaled(SUITE_TIMEOUT_S)))


@pytest.fixture(scope="session")
def tok():
    """A real byte-level BPE tokenizer with Flywheel's special tokens, trained on a little stdlib code."""
    import inspect
    import json
    import textwrap

    from learner.tokenizer import train_tokenizer

    return train_tokenizer([inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap)], vocab_size=512)


@pytest.fixture(scope="session")
def fmt(tok):
    """The prompt format of a model with that tokenizer (learner.formats), as its export reads it."""
    from learner.formats import own_format

    return own_format(tok, 2048)


@pytest.fixture(scope="session")
def kafka_settings(tmp_path_factory) -> FlywheelSettings:
    """A real single-node Kafka broker for the whole test session, with Flywheel's topics."""
    from feedback import bus
    from ops import kafka_broker

    tmp = tmp_path_factory.mktemp("kafka")
    s = make_settings(tmp, kafka={"port": free_port(), "controller_port": free_port()})
    kafka_broker.start(s, progress=lambda msg: None)
    try:
        bus.wait_until_ready(s.kafka, scaled(s.kafka.start_timeout_s))
        bus.ensure_topics(s.kafka)
        yield s
    finally:
        kafka_broker.stop(s)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS, tests/s3_server.py) on free ports for the whole session, with a
    fresh bucket; built into the user's cache the first time (a few minutes)."""
    from tests import s3_server

    t0 = time.monotonic()
    binary = s3_server.seaweedfs_binary(s3_server.cache_dir(), progress=print)
    built = time.monotonic() - t0
    server = s3_server.start(binary, tmp_path_factory.mktemp("seaweedfs"))
    print(
        f"\nS3 server: SeaweedFS at {server.endpoint} (binary ready in {built:.1f} s, started in {server.start_s:.1f} s)"
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_uri(s3_server) -> str:
    """A fresh prefix of the session's bucket, as a weight-store URI."""
    return f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    url = os.environ.get("FLYWHEEL_TEST_POSTGRES_URL")
    if not url:
        if os.environ.get("CI"):
            pytest.fail("FLYWHEEL_TEST_POSTGRES_URL is not set; .ci/run must start PostgreSQL and set it")
        pytest.skip("FLYWHEEL_TEST_POSTGRES_URL not set (CI sets it; see .ci/run)")
    return url


@pytest.fixture
def postgres_url(postgres_admin_url):
    """A fresh, empty PostgreSQL database for one test, dropped afterwards."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"flywheel_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(
        make_url(postgres_admin_url).set(drivername="postgresql+psycopg"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield (
            make_url(postgres_admin_url)
            .set(drivername="postgresql+psycopg", database=name)
            .render_as_string(hide_password=False)
        )
    finally:
        # FORCE ends the test's own sessions, but a non-superuser may not end an autovacuum
        # worker that happens to be in the database: wait for it and try again.
        from sqlalchemy.exc import DBAPIError

        for attempt in range(20):
            try:
                with admin.connect() as conn:
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
                break
            except DBAPIError:
                if attempt == 19:
                    raise
                time.sleep(0.5)
        admin.dispose()
