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
    from ops.simulate import SimulateSettings

    sim = SimulateSettings.load(example)
    from feedback.query import QuerySettings
    from feedback.sink.loop import SinkSettings
    from learner.train.learn_settings import LearnSettings
    from ops.demo import DemoSettings
    from ops.rollout import RolloutSettings

    learn, rollout, demo = LearnSettings.load(example), RolloutSettings.load(example), DemoSettings.load(example)
    sink, query = SinkSettings.load(example), QuerySettings.load(example)
    assert learn.learn.publish_every == 3 * 3600 and learn.learn.gate.sites == 48
    sections = (
        ("kafka", s.kafka),
        ("database", s.database),
        ("sink", sink.sink),
        ("sink.reward", sink.sink.reward),
        ("query", query.query),
        ("serve", sim.serve),
        ("serve.engine", sim.serve.engine),
        ("simulate", sim.simulate),
        ("learn", learn.learn),
        ("learn.gate", learn.learn.gate),
        ("rollout", rollout.rollout),
        ("rollout.thresholds", rollout.rollout.thresholds),
        ("demo", demo.demo),
    )
    for section, model in sections:
        for name in type(model).model_fields:
            documented = f"\n{name} =" in text or f"\n# {name} =" in text or f"[{section}.{name}]" in text
            assert documented, f"{section}.{name} missing from the example config"
    for name in ("data_dir", "cache_dir"):
        assert f"# {name} =" in text
