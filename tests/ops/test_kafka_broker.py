"""The local broker's configuration with `kafka.local_listener = "sasl_ssl"` (no broker started here;
tests/feedback/test_bus_security.py runs one)."""

import stat

import pytest

from feedback.core.errors import UserError
from ops import kafka_broker
from tests.helpers import make_settings

SASL_SSL = {
    "local_listener": "sasl_ssl",
    "sasl_mechanism": "SCRAM-SHA-256",
    "sasl_username": "u",
    "sasl_password": "user-s3cret",
}


def test_plaintext_broker_config_is_unchanged(tmp_path):
    s = make_settings(tmp_path)
    config = kafka_broker.server_properties(s, tmp_path)
    assert "listeners=PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093" in config
    assert "sasl" not in config and "ssl" not in config


def test_sasl_ssl_broker_config_has_no_open_listener(tmp_path):
    s = make_settings(tmp_path, kafka=SASL_SSL)
    paths = kafka_broker.BrokerPaths.of(s)
    secured = kafka_broker._secure(s, paths, progress=lambda line: None)
    config = kafka_broker.server_properties(s, paths.data, secured)
    assert "PLAINTEXT" not in config.replace("SASL_PLAINTEXT", "")
    assert "listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:SSL" in config
    assert "listener.name.controller.ssl.client.auth=required" in config
    # The user's mechanism and the broker's own; a JAAS entry for each.
    assert "sasl.enabled.mechanisms=SCRAM-SHA-256,SCRAM-SHA-512" in config
    for m in ("scram-sha-256", "scram-sha-512"):
        assert (
            f'listener.name.sasl_ssl.{m}.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="flywheel-broker"'
            in config
        )
    assert f"ssl.keystore.location={paths.tls / 'broker.pem'}" in config
    assert f"ssl.truststore.location={s.local_kafka_ca}" in config
    assert "user-s3cret" not in config  # only the broker's own password is in the file
    assert stat.S_IMODE(paths.login.stat().st_mode) == 0o600
    assert kafka_broker._secure(s, paths, progress=lambda line: None) == secured  # kept across `up`s


def test_a_storage_formatted_without_sasl_ssl_cannot_switch(tmp_path):
    s = make_settings(tmp_path, kafka=SASL_SSL)
    paths = kafka_broker.BrokerPaths.of(s)
    (paths.data / "logs").mkdir(parents=True)
    (paths.data / "logs" / "meta.properties").write_text("formatted by an earlier plaintext `up`\n")
    with pytest.raises(UserError, match="was formatted without it"):
        kafka_broker._secure(s, paths, progress=lambda line: None)
