import os

import pytest

from feedback.core.threads import WAIT_POLICY, prefer_passive_waiting


def test_passive_waiting_is_the_default_and_a_users_choice_is_kept(monkeypatch):
    monkeypatch.delenv(WAIT_POLICY, raising=False)
    prefer_passive_waiting()
    assert os.environ[WAIT_POLICY] == "PASSIVE"

    monkeypatch.setenv(WAIT_POLICY, "ACTIVE")
    prefer_passive_waiting()
    assert os.environ[WAIT_POLICY] == "ACTIVE"


def test_the_flywheel_command_asks_for_it_before_any_command_runs(monkeypatch):
    from ops.cli.main import main

    monkeypatch.delenv(WAIT_POLICY, raising=False)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ[WAIT_POLICY] == "PASSIVE"


def test_the_test_session_runs_with_it():
    """conftest.py sets it before torch loads: the suite's own vLLM and Ray share its cores."""
    assert os.environ.get(WAIT_POLICY)
