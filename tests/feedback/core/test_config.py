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
