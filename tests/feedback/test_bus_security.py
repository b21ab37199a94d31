"""Kafka over TLS and SASL: the options every client gets, what a refusal says, and a real
SASL_SSL-only broker (the one `flywheel up` runs with `kafka.local_listener = "sasl_ssl"`)."""

from __future__ import annotations

import datetime as dt
import json
import secrets
import time
import uuid

import pytest
from kafka.errors import KafkaConnectionError, SaslAuthenticationFailedError, UnsupportedSaslMechanismError
from pydantic import SecretStr

from feedback import bus
from feedback.core.config import KafkaSettings
from feedback.core.errors import UserError
from tests.helpers import flywheel, free_port, make_settings, scaled

# --- the options and the messages, without a broker ------------------------------------------------


def _sasl_ssl(**extra) -> KafkaSettings:
    return KafkaSettings(
        bootstrap_servers="kafka-1:9093",
        security_protocol="SASL_SSL",
        ssl_system_trust=True,
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="svc",
        sasl_password=SecretStr("s3cret"),
        **extra,
    )


def test_plaintext_clients_get_no_security_options():
    assert bus.security_options(KafkaSettings()) == {"security_protocol": "PLAINTEXT"}


def test_sasl_ssl_clients_get_kafka_python_options():
    opts = bus.security_options(_sasl_ssl(ssl_check_hostname=False))
    assert opts == {
        "security_protocol": "SASL_SSL",
        "ssl_cafile": None,  # ssl_system_trust: kafka-python loads the system's CA store
        "ssl_certfile": None,
        "ssl_keyfile": None,
        "ssl_password": None,
        "ssl_check_hostname": False,
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "svc",
        "sasl_plain_password": "s3cret",
    }


def test_a_missing_local_ca_says_up_writes_it(tmp_path):
    k = KafkaSettings(
        local_listener="sasl_ssl",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="svc",
        sasl_password=SecretStr("pw"),
        ssl_cafile=tmp_path / "ca.pem",
    )
    with pytest.raises(UserError, match="does not exist; `flywheel up` writes it"):
        bus.security_options(k)


@pytest.mark.parametrize(
    "error, in_login, expected",
    [
        (
            SaslAuthenticationFailedError(
                "SaslAuthenticationFailedError: Authentication failed during authentication due to invalid credentials"
            ),
            True,
            "Kafka at kafka-1:9093 refused the SASL login for user svc (SCRAM-SHA-512): Authentication failed during",
        ),
        (
            KafkaConnectionError("socket disconnected"),
            True,
            "refused the SASL login for user svc (SCRAM-SHA-512): it closed the connection during the login",
        ),
        (
            UnsupportedSaslMechanismError("... Enabled mechanisms: ['PLAIN']"),
            True,
            "does not offer the SASL mechanism SCRAM-SHA-512 (it offers ['PLAIN'])",
        ),
        (
            KafkaConnectionError(
                "Handshake failed: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate"
            ),
            False,
            "Kafka at kafka-1:9093: TLS handshake failed: [SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed",
        ),
        (
            KafkaConnectionError("Handshake failed: [SSL: CERTIFICATE_VERIFY_FAILED] Hostname mismatch"),
            False,
            "does not name the host dialed",
        ),
        (FileNotFoundError(2, "No such file or directory"), False, "TLS setup failed before connecting"),
    ],
)
def test_a_refusal_is_one_line_that_says_what_to_check(error, in_login, expected):
    line = bus.refusal(_sasl_ssl(), "kafka-1:9093", error, in_login=in_login)
    assert line is not None and expected in line and "\n" not in line
    assert "s3cret" not in line


@pytest.mark.parametrize(
    "error, in_login",
    [
        (KafkaConnectionError("111 ECONNREFUSED"), False),  # down or the wrong port: the client says so
        (KafkaConnectionError("socket disconnected"), False),  # before ApiVersions: not a login
        (ConnectionRefusedError(111, "refused"), False),
    ],
)
def test_an_unreachable_broker_is_not_a_refusal(error, in_login):
    assert bus.refusal(_sasl_ssl(), "kafka-1:9093", error, in_login=in_login) is None


# --- a real SASL_SSL-only broker -------------------------------------------------------------------


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """`flywheel up` with `kafka.local_listener = "sasl_ssl"`, run as a user runs it: certificates
    generated into the test's own data folder, its own ports, a random password for the test's
    user in the environment. Yields the settings and what `up` printed."""
    from ops import kafka_broker

    tmp = tmp_path_factory.mktemp("kafka-sasl-ssl")
    password = secrets.token_urlsafe(16)
    kafka = {
        "port": free_port(),
        "controller_port": free_port(),
        "local_listener": "sasl_ssl",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": "flywheel-test",
        "start_timeout_s": scaled(90),
    }
    s = make_settings(tmp, kafka=kafka | {"sasl_password": password})
    sets = [a for name, value in kafka.items() for a in ("--set", f"kafka.{name}={json.dumps(value)}")]
    try:
        r = flywheel("up", *sets, env={"FLYWHEEL_KAFKA__SASL_PASSWORD": password}, tmp_path=tmp, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert password not in r.stdout + r.stderr  # the resolved config it prints masks it
        yield s, r.stdout
    finally:
        kafka_broker.stop(s)


@pytest.mark.slow
@pytest.mark.kafka
def test_the_broker_listens_with_sasl_ssl_only(secured):
    from ops import kafka_broker

    s, printed = secured
    assert "generated a CA and a broker certificate for 127.0.0.1" in printed
    assert "setting the SCRAM login of Kafka user flywheel-test" in printed
    config = kafka_broker.BrokerPaths.of(s).config.read_text()
    assert "PLAINTEXT://" not in config and f"SASL_SSL://127.0.0.1:{s.kafka.port}" in config
    assert "listener.name.controller.ssl.client.auth=required" in config
    assert s.kafka.sasl_password.get_secret_value() not in config  # the user's password is nowhere on disk
    assert s.kafka.ssl_cafile == s.data_dir / "kafka" / "tls" / "ca.pem"
    # A PLAINTEXT client gets nothing from the client port: no metadata, no records.
    plain = s.kafka.model_copy(
        update={
            "security_protocol": "PLAINTEXT",
            "local_listener": "plaintext",
            "sasl_mechanism": None,
            "sasl_username": "",
            "sasl_password": None,
            "ssl_cafile": None,
        }
    )
    with pytest.raises(UserError, match="unreachable"):
        bus.admin(plain, timeout_s=scaled(3))


@pytest.mark.slow
@pytest.mark.kafka
def test_round_trip_through_flywheel_clients(secured):
    s, _ = secured
    key = uuid.uuid4().hex.encode()
    p = bus.producer(s.kafka)
    try:
        p.send(bus.EVENTS, key=key, value=b'{"over": "sasl_ssl"}').get(timeout=scaled(30))
    finally:
        p.close()
    c = bus.consumer(s.kafka, bus.EVENTS, group_id=f"t-{uuid.uuid4().hex}", consumer_timeout_ms=int(scaled(20_000)))
    try:
        got = next((m.value for m in c if m.key == key), None)
    finally:
        c.close()
    assert got == b'{"over": "sasl_ssl"}'
    assert {t.name for t in bus.describe_topics(s.kafka)} >= {bus.COMPLETIONS, bus.EVENTS, bus.VERSIONS}


@pytest.mark.slow
@pytest.mark.kafka
def test_the_sink_reads_over_sasl_ssl(secured, tmp_path):
    from feedback import db
    from tests.feedback.sink.sink_support import (
        completion,
        count,
        private_topics,
        produce,
        running_sink,
        sink_settings,
        wait_until,
    )

    s, _ = secured
    url = f"sqlite:///{tmp_path / 'sink.db'}"
    with private_topics(s) as topics:
        settings = sink_settings(s, url, topics)
        engine = db.make_engine(url)
        db.upgrade(engine)
        cid = f"c-{uuid.uuid4().hex[:8]}"
        produce(s, [(topics[0], completion(cid))])
        with running_sink(settings):
            wait_until(lambda: count(engine, "completions", completion_id=cid) == 1, 60, "the sink's row")
        engine.dispose()


@pytest.mark.slow
@pytest.mark.kafka
def test_a_wrong_password_is_refused_at_once_by_every_client(secured):
    s, _ = secured
    wrong = s.kafka.model_copy(update={"sasl_password": SecretStr("not-" + s.kafka.sasl_password.get_secret_value())})
    bound = scaled(10)  # a refusal takes one connection; kafka-python alone would wait out its 30 s bootstrap
    for make in (
        lambda: bus.admin(wrong),
        lambda: bus.producer(wrong),
        lambda: bus.consumer(wrong, bus.EVENTS, group_id="t-wrong"),
        lambda: bus.wait_until_ready(wrong, scaled(60)),
    ):
        t0 = time.monotonic()
        with pytest.raises(bus.KafkaRefused) as e:
            make()
        assert time.monotonic() - t0 < bound
        assert str(e.value).startswith(
            f"Kafka at 127.0.0.1:{s.kafka.port} refused the SASL login for user flywheel-test"
        )
        assert "not-" not in str(e.value)


@pytest.mark.slow
@pytest.mark.kafka
def test_a_mechanism_the_broker_does_not_offer_is_named(secured):
    s, _ = secured
    other = s.kafka.model_copy(update={"sasl_mechanism": "SCRAM-SHA-256"})
    with pytest.raises(bus.KafkaRefused, match="SCRAM-SHA-256"):
        bus.admin(other)


@pytest.mark.slow
@pytest.mark.kafka
def test_an_untrusted_ca_fails_the_tls_handshake(secured, tmp_path):
    from ops import kafka_tls

    s, _ = secured
    stranger = kafka_tls.make_ca("someone else's CA", now=dt.datetime.now(dt.UTC))
    (tmp_path / "other-ca.pem").write_bytes(kafka_tls.pem_cert(stranger.cert))
    untrusting = s.kafka.model_copy(update={"ssl_cafile": tmp_path / "other-ca.pem"})
    t0 = time.monotonic()
    with pytest.raises(bus.KafkaRefused) as e:
        bus.producer(untrusting)
    assert time.monotonic() - t0 < scaled(10)
    assert f"Kafka at 127.0.0.1:{s.kafka.port}: TLS handshake failed: [SSL: CERTIFICATE_VERIFY_FAILED]" in str(e.value)
    assert "other-ca.pem) did not sign the broker's certificate" in str(e.value)


@pytest.mark.slow
@pytest.mark.kafka
def test_the_sink_command_says_so_in_one_line(secured):
    s, _ = secured
    r = flywheel(
        "sink",
        "--set",
        f"kafka.port={s.kafka.port}",
        "--set",
        f"kafka.controller_port={s.kafka.controller_port}",
        "--set",
        'kafka.local_listener="sasl_ssl"',
        "--set",
        'kafka.sasl_mechanism="SCRAM-SHA-512"',
        "--set",
        "kafka.sasl_username=flywheel-test",
        env={"FLYWHEEL_DATA_DIR": str(s.data_dir), "FLYWHEEL_KAFKA__SASL_PASSWORD": "wrong-password"},
        timeout=120,
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and "Traceback" not in r.stderr + r.stdout, r.stderr
    assert lines == [lines[0]] and lines[0].startswith("flywheel: error: Kafka at 127.0.0.1:"), r.stderr
    assert "refused the SASL login for user flywheel-test" in lines[0] and "wrong-password" not in r.stderr + r.stdout


@pytest.mark.slow
@pytest.mark.kafka
def test_the_buffered_producer_logs_a_refusal_once_and_keeps_its_records(secured, caplog):
    """Serving and the learner send through BufferedProducer: a refusal must not end its thread."""
    import logging

    from prometheus_client import REGISTRY

    from feedback.producer import BufferedProducer
    from feedback.schemas import FeedbackEvent

    s, _ = secured
    wrong = s.kafka.model_copy(update={"sasl_password": SecretStr("wrong-password")})
    attempts = lambda: REGISTRY.get_sample_value("flywheel_producer_errors_total") or 0.0  # noqa: E731
    before = attempts()
    caplog.set_level(logging.ERROR, logger="feedback.producer")
    p = BufferedProducer(wrong, retry_backoff_s=0.05)
    try:
        assert p.send(bus.EVENTS, FeedbackEvent(completion_id="c-refused", type="view"))
        deadline = time.monotonic() + scaled(30)
        while attempts() < before + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert attempts() >= before + 3, "the producer stopped retrying"
        refusals = [r for r in caplog.records if "refused the SASL login for user flywheel-test" in r.getMessage()]
        assert len(refusals) == 1  # once, not at every retry
        assert p.buffered == 1 and p._thread.is_alive()
    finally:
        p.close(timeout_s=1)
