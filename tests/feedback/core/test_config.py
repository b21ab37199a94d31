import pytest

from feedback.core.config import StackSettings, parse_overrides
from feedback.core.errors import UserError
from tests.helpers import REPO


def test_precedence_cli_over_env_over_toml_over_default(tmp_path, monkeypatch):
    cfg = tmp_path / "flywheel.toml"
    cfg.write_text('[kafka]\nport = 9100\nheap = "1g"\n[database]\nurl = "sqlite:///from-toml.db"\n')
    monkeypatch.setenv("FLYWHEEL_KAFKA__HEAP", "2g")
    s = StackSettings.load(cfg, ["database.url=sqlite:///from-cli.db"])
    assert s.kafka.port == 9100  # TOML over default
    assert s.kafka.heap == "2g"  # env over TOML
    assert s.database_url == "sqlite:///from-cli.db"  # CLI over TOML
    assert s.kafka.controller_port == 9093  # default


def test_defaults_put_sqlite_in_the_data_folder(tmp_path):
    s = StackSettings.load(None, [f"data_dir={tmp_path}"])
    assert s.database_url == f"sqlite:///{tmp_path / 'flywheel.db'}"
    assert s.kafka.managed and s.kafka.bootstrap == "127.0.0.1:9092"


def test_external_cluster_disables_the_local_broker():
    s = StackSettings.load(None, ["kafka.bootstrap_servers=k1:9092,k2:9092"])
    assert not s.kafka.managed and s.kafka.bootstrap == "k1:9092,k2:9092"


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("kafka.port=70000", "kafka.port"),
        ("kafka.heap=lots", "kafka.heap"),
        ("kafka.completions.partitions=0", "kafka.completions.partitions"),
        ("kafka.prot=9000", "kafka.prot"),  # a typo inside a section is caught
        ("kafka.controller_port=9092", "must differ"),
    ],
)
def test_bad_values_raise_one_line_errors(override, fragment):
    with pytest.raises(UserError) as e:
        StackSettings.load(None, [override])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[kafka\nport = 1")
    with pytest.raises(UserError, match="bad configuration file"):
        StackSettings.load(bad)
    with pytest.raises(UserError, match="does not exist"):
        StackSettings.load(tmp_path / "missing.toml")


def test_parse_overrides_types_and_nesting():
    assert parse_overrides(["a.b=3", "a.c=true", "d=hello world", "e=[1, 2]"]) == {
        "a": {"b": 3, "c": True},
        "d": "hello world",
        "e": [1, 2],
    }
    with pytest.raises(UserError, match="KEY=VALUE"):
        parse_overrides(["novalue"])


def test_redacted_hides_database_password():
    s = StackSettings.load(None, ["database.url=postgresql+psycopg://ana:s3cret@db:5432/fw"])
    shown = s.redacted()["database"]["url"]
    assert "s3cret" not in shown and "ana" in shown


def test_example_config_is_valid_and_complete():
    """The shipped example config loads, and documents every stack setting."""

    example = REPO / "flywheel.example.toml"
    s = StackSettings.load(example)
    text = example.read_text()
    from feedback.query import QuerySettings
    from feedback.sink.loop import SinkSettings
    from learner.train.learn_settings import LearnSettings
    from ops.demo import DemoSettings
    from ops.rollout.settings import RolloutSettings
    from ops.soak.settings import SoakSettings

    learn, rollout, demo = LearnSettings.load(example), RolloutSettings.load(example), DemoSettings.load(example)
    sim = demo  # every section the loop uses, [serve] and [simulate] among them
    sink, query = SinkSettings.load(example), QuerySettings.load(example)
    soak = SoakSettings.load(example)
    assert learn.learn.publish_every == 3 * 3600 and learn.learn.gate.sites == 48 and demo.eval.sites == 500
    sections = (
        ("kafka", s.kafka),
        ("database", s.database),
        ("store", s.store),
        ("store.s3", s.store.s3),
        ("sink", sink.sink),
        ("sink.reward", sink.sink.reward),
        ("query", query.query),
        ("serve", sim.serve),
        ("serve.engine", sim.serve.engine),
        ("serve.limits", sim.serve.limits),
        ("serve.dashboard", sim.serve.dashboard),
        ("simulate", sim.simulate),
        ("learn", learn.learn),
        ("learn.gate", learn.learn.gate),
        ("eval", demo.eval),
        ("rollout", rollout.rollout),
        ("rollout.thresholds", rollout.rollout.thresholds),
        ("demo", demo.demo),
        ("model", demo.model),
        ("pretrain", learn.pretrain),
        ("soak", soak.soak),
    )
    for section, model in sections:
        for name in type(model).model_fields:
            documented = f"\n{name} =" in text or f"\n# {name} =" in text or f"[{section}.{name}]" in text
            assert documented, f"{section}.{name} missing from the example config"
    for name in ("data_dir", "cache_dir"):
        assert f"# {name} =" in text


# --- secrets never echoed (reliability finding 4) -------------------------------------------------


@pytest.mark.parametrize(
    "override",
    [
        "serve.auth_tokens=s3cret-editor-token",  # a string where a list belongs
        'serve.auth_tokens=["ok", 7]',
        "serve.ops_tokens=s3cret-editor-token",
        "simulate.token=[1, 2]",
    ],
)
def test_config_errors_never_echo_secret_values(override):
    """`_one_line` printed the rejected value: `(got 's3cret-editor-token')` for serve.auth_tokens."""
    from ops.demo import DemoSettings  # has [serve] and [simulate]

    with pytest.raises(UserError) as e:
        DemoSettings.load(None, [override])
    message = str(e.value)
    assert override.split("=")[0] in message and "value hidden: secret" in message
    assert "s3cret" not in message and "(got" not in message


def test_secretstr_fields_are_hidden_whatever_their_name():
    from pydantic import SecretStr

    from feedback.core.config import FlywheelSettings, Section

    class Vault(Section):
        api_key: SecretStr = SecretStr("")
        label: str = ""

    class VaultSettings(FlywheelSettings):
        vault: Vault = Vault()

    with pytest.raises(UserError) as e:
        VaultSettings.load(None, ["vault.api_key=[123456]"])
    assert "vault.api_key" in str(e.value) and "123456" not in str(e.value)
    with pytest.raises(UserError, match=r"vault.label: .*\(got \[42\]\)"):  # other values are still shown
        VaultSettings.load(None, ["vault.label=[42]"])


def test_a_url_in_a_config_error_has_its_password_masked(monkeypatch):
    from feedback.core.config import FlywheelSettings, Section

    class Probe(Section):
        port: int = 0

    class ProbeSettings(FlywheelSettings):
        probe: Probe = Probe()

    with pytest.raises(UserError) as e:
        ProbeSettings.load(None, ["probe.port=postgresql://ana:s3cret@db/fw"])
    assert "s3cret" not in str(e.value) and "postgresql://ana:***@db/fw" in str(e.value)


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://ana:s3cret@db:port/fw",  # a port that is not a number
        "postgresql+psycopg://ana:s3cret@[::1/fw",
        "postgres ql://ana:s3cret@db/fw",  # does not parse at all
        "ana:s3cret@db/fw",
        "mysql://ana:s3cret@db/fw",  # not a database Flywheel supports
        "postgresql+nodriver://ana:s3cret@db/fw",  # no such driver
    ],
)
def test_a_bad_database_url_error_masks_the_password(url):
    """make_engine printed `bad database URL 'postgresql+psycopg://ana:s3cret@...'`, or let a
    ValueError (a non-numeric port) or an import error out with a traceback."""
    from feedback import db

    with pytest.raises(UserError, match="bad database URL") as e:
        db.make_engine(url)
    assert "s3cret" not in str(e.value) and "***" in str(e.value)


@pytest.mark.parametrize(
    "query",
    ["", "?foo=bar", "?connect_timeout=soon"],  # refused, an unknown option, a bad option value
)
def test_an_unreachable_database_error_masks_the_password(query):
    from feedback import db
    from tests.helpers import free_port

    engine = db.make_engine(f"postgresql+psycopg://ana:s3cret@127.0.0.1:{free_port()}/fw{query}")
    for step in (db.upgrade, db.current_revision):
        with pytest.raises(UserError, match="is unreachable") as e:
            step(engine)
        assert "s3cret" not in str(e.value) and "ana:***@127.0.0.1" in str(e.value)


def test_mask_secrets_in_any_message():
    from feedback.core.errors import first_line, mask_secrets

    assert mask_secrets("to postgresql://u:p@ss@h/d failed") == "to postgresql://u:***@h/d failed"
    assert mask_secrets("dsn host=h password=s3cret user=u") == "dsn host=h password=*** user=u"
    assert mask_secrets("sqlite:///x.db; mail a@b; http://h:80/p") == "sqlite:///x.db; mail a@b; http://h:80/p"
    assert first_line(RuntimeError("cannot reach postgresql://u:s3cret@h/d\nmore")) == (
        "RuntimeError: cannot reach postgresql://u:***@h/d"
    )
    assert str(UserError("bad postgresql://u:s3cret@h/d")) == "bad postgresql://u:***@h/d"


# --- Kafka security settings ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A CA, a client certificate and its key (plain and encrypted), made with ops.kafka_tls."""
    import datetime as dt

    from cryptography.hazmat.primitives import serialization

    from ops import kafka_tls

    folder = tmp_path_factory.mktemp("tls")
    now = dt.datetime.now(dt.UTC)
    ca = kafka_tls.make_ca("test CA", now=now)
    client = kafka_tls.make_leaf(ca, ["client"], now=now)
    encrypted = client.key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,  # the form Python's ssl decrypts
        serialization.BestAvailableEncryption(b"key-pass"),
    )
    files = {
        "ca": kafka_tls.pem_cert(ca.cert),
        "cert": kafka_tls.pem_cert(client.cert),
        "key": kafka_tls.pem_key(client.key),
        "key_encrypted": encrypted,
        "junk": b"not a certificate\n",
    }
    for name, data in files.items():
        (folder / f"{name}.pem").write_bytes(data)
    return {name: folder / f"{name}.pem" for name in files}


EXTERNAL = "kafka.bootstrap_servers=kafka-1:9093"
SASL = ["kafka.sasl_mechanism=SCRAM-SHA-512", "kafka.sasl_username=svc", "kafka.sasl_password=pw-123"]


def test_kafka_defaults_to_plaintext_without_login():
    k = StackSettings.load(None, []).kafka
    assert (k.security_protocol, k.uses_tls, k.uses_sasl) == ("PLAINTEXT", False, False)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            [EXTERNAL, "kafka.security_protocol=SASL_PLAINTEXT"],
            "needs kafka.sasl_mechanism, kafka.sasl_username, kafka.sasl_password",
        ),
        (
            [EXTERNAL, "kafka.security_protocol=SASL_PLAINTEXT", "kafka.sasl_mechanism=PLAIN", "kafka.sasl_username=u"],
            "needs kafka.sasl_password",
        ),
        ([EXTERNAL, "kafka.security_protocol=SASL_PLAINTEXT", "kafka.sasl_mechanism=GSSAPI"], "kafka.sasl_mechanism"),
        ([EXTERNAL, "kafka.security_protocol=TLS"], "kafka.security_protocol"),
        (
            ["kafka.sasl_username=svc"],
            "kafka.sasl_username is set but kafka.security_protocol = PLAINTEXT sends no login",
        ),
        ([EXTERNAL, "kafka.security_protocol=SASL_PLAINTEXT", *SASL, "kafka.ssl_system_trust=true"], "uses no TLS"),
        (
            [EXTERNAL, "kafka.security_protocol=SSL"],
            "needs the CA that signed the brokers' certificates",
        ),
        (
            ["kafka.security_protocol=SSL"],
            'the local broker `flywheel up` runs listens with PLAINTEXT: set kafka.local_listener = "sasl_ssl"',
        ),
        (
            [EXTERNAL, "kafka.security_protocol=SASL_SSL", *SASL],
            "kafka.ssl_cafile to its PEM file, or kafka.ssl_system_trust = true",
        ),
        (
            [EXTERNAL, "kafka.security_protocol=SSL", "kafka.ssl_cafile=/nonexistent/ca.pem"],
            "/nonexistent/ca.pem is not a readable file",
        ),
        (
            ["kafka.local_listener=sasl_ssl", "kafka.bootstrap_servers=k:9092", *SASL],
            "applies to the broker `flywheel up` runs",
        ),
        (
            ["kafka.local_listener=sasl_ssl", *SASL[1:], "kafka.sasl_mechanism=PLAIN"],
            "stores SCRAM credentials, not PLAIN",
        ),
        (["kafka.local_listener=sasl_ssl", "kafka.security_protocol=SSL", *SASL], "listens with SASL_SSL only"),
        (
            [
                "kafka.local_listener=sasl_ssl",
                "kafka.sasl_mechanism=SCRAM-SHA-512",
                "kafka.sasl_username=flywheel-broker",
                "kafka.sasl_password=x",
            ],
            "the local broker's own login",
        ),
        (["kafka.local_listener=sasl_ssl"], "needs kafka.sasl_mechanism, kafka.sasl_username, kafka.sasl_password"),
    ],
)
def test_incomplete_kafka_security_is_one_clear_error(overrides, fragment):
    with pytest.raises(UserError) as e:
        StackSettings.load(None, overrides)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert "pw-123" not in str(e.value)


def test_kafka_tls_files_are_checked_when_loaded(tls_files):
    ssl_ca = [EXTERNAL, "kafka.security_protocol=SSL", f"kafka.ssl_cafile={tls_files['ca']}"]
    k = StackSettings.load(None, ssl_ca).kafka
    assert k.uses_tls and k.ssl_cafile == tls_files["ca"]
    with pytest.raises(UserError, match="holds no PEM certificate"):
        StackSettings.load(None, [EXTERNAL, "kafka.security_protocol=SSL", f"kafka.ssl_cafile={tls_files['junk']}"])
    with pytest.raises(UserError, match="exclude each other"):
        StackSettings.load(None, [*ssl_ca, "kafka.ssl_system_trust=true"])
    with pytest.raises(UserError, match="kafka.ssl_keyfile needs kafka.ssl_certfile"):
        StackSettings.load(None, [*ssl_ca, f"kafka.ssl_keyfile={tls_files['key']}"])
    mtls = [*ssl_ca, f"kafka.ssl_certfile={tls_files['cert']}"]
    assert (
        StackSettings.load(None, [*mtls, f"kafka.ssl_keyfile={tls_files['key']}"]).kafka.ssl_keyfile == tls_files["key"]
    )
    with pytest.raises(UserError, match="with its key cannot be loaded"):  # a certificate without its key
        StackSettings.load(None, mtls)
    encrypted = [*mtls, f"kafka.ssl_keyfile={tls_files['key_encrypted']}"]
    k = StackSettings.load(None, [*encrypted, "kafka.ssl_key_password=key-pass"]).kafka
    assert k.ssl_key_password.get_secret_value() == "key-pass"
    with pytest.raises(UserError, match="kafka.ssl_key_password if the key is encrypted") as e:
        StackSettings.load(None, [*encrypted, "kafka.ssl_key_password=wrong-pass"])
    assert "wrong-pass" not in str(e.value)


def test_kafka_passwords_are_secret_in_the_dump_and_read_from_the_environment(tls_files, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_KAFKA__SASL_PASSWORD", "env-s3cret")
    monkeypatch.setenv("FLYWHEEL_KAFKA__SSL_KEY_PASSWORD", "key-pass")
    s = StackSettings.load(
        None,
        [
            EXTERNAL,
            "kafka.security_protocol=SASL_SSL",
            "kafka.sasl_mechanism=PLAIN",
            "kafka.sasl_username=API-KEY",
            "kafka.ssl_system_trust=true",
            f"kafka.ssl_certfile={tls_files['cert']}",
            f"kafka.ssl_keyfile={tls_files['key_encrypted']}",
        ],
    )
    assert s.kafka.sasl_password.get_secret_value() == "env-s3cret"
    dumped = repr(s.redacted()) + repr(s) + str(s.kafka)
    assert "env-s3cret" not in dumped and "key-pass" not in dumped
    assert s.redacted()["kafka"]["sasl_username"] == "API-KEY"


def test_local_sasl_ssl_broker_implies_sasl_ssl_with_the_generated_ca(tmp_path):
    s = StackSettings.load(None, [f"data_dir={tmp_path}", "kafka.local_listener=sasl_ssl", *SASL])
    assert s.kafka.security_protocol == "SASL_SSL" and s.kafka.uses_tls and s.kafka.uses_sasl
    assert s.kafka.ssl_cafile == tmp_path / "kafka" / "tls" / "ca.pem" == s.local_kafka_ca  # written by `up`
    # A process handed the dumped settings (sink, serving) reads the same section back.
    again = StackSettings(data_dir=tmp_path, kafka=s.kafka.model_dump())
    assert again.kafka == s.kafka
