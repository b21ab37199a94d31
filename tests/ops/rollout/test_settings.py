"""The [rollout] settings: documented in the example config, and refused when they make no sense."""

import pytest

from ops.rollout.settings import RolloutSection, RolloutSettings
from tests.helpers import REPO


def test_example_config_documents_every_rollout_setting():
    example = REPO / "flywheel.example.toml"
    s = RolloutSettings.load(example)
    text = example.read_text()
    for section, model in (("rollout", s.rollout), ("rollout.thresholds", s.rollout.thresholds)):
        for name in type(model).model_fields:
            assert f"\n{name} =" in text or f"\n# {name} =" in text or f"[{section}.{name}]" in text, (
                f"{section}.{name} missing from the example config"
            )
    assert s.rollout == RolloutSection()  # the example shows the defaults


def test_settings_refuse_bad_weights():
    from feedback.core.errors import UserError

    with pytest.raises(UserError, match="increasing percentages"):
        RolloutSettings.load(None, ["rollout.weights=[50, 25]"])
    from feedback.core.config import parse_duration

    assert parse_duration("1.5h") == 5400 and parse_duration("90") == 90 and parse_duration("1h30m") == 5400
    assert RolloutSettings.load(None, ['rollout.interval_s="2m"']).rollout.interval_s == 120
    for bad in ("", "3x", "-5s", "0"):
        with pytest.raises(ValueError):
            parse_duration(bad)
