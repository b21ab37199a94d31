"""serving/engine.py's pure parts: how CPU model workers share a replica's cores."""

from __future__ import annotations

import pytest

from serving.engine import cpu_binding


@pytest.mark.parametrize(
    ("cpus", "workers", "bind"),
    [
        ([0, 1], 2, "0|1"),
        ([0, 1, 2, 3], 2, "0,1|2,3"),
        ([4, 5, 6, 7, 8], 2, "4,5|6,7,8"),
        ([0, 1, 2], 1, "0,1,2"),
    ],
)
def test_each_cpu_worker_gets_its_own_contiguous_share_of_the_cores(cpus, workers, bind):
    assert cpu_binding(cpus, workers) == bind


def test_more_cpu_workers_than_cores_is_refused():
    with pytest.raises(ValueError, match="2 CPU model workers need at least as many cores"):
        cpu_binding([3], 2)


@pytest.mark.parametrize(
    ("binding", "during"),
    [("auto", None), ("nobind", "nobind"), ("0-3", "0-3")],
)
def test_a_replicas_cpu_binding_is_passed_to_vllm_only_while_the_engine_starts(monkeypatch, binding, during):
    import os

    from serving.engine import _cpu_workers_bound
    from serving.settings import EngineSettings

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    with _cpu_workers_bound(EngineSettings(cpu_binding=binding)):
        assert os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == during
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ


def test_a_binding_the_user_set_wins(monkeypatch):
    import os

    from serving.engine import _cpu_workers_bound
    from serving.settings import EngineSettings

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    with _cpu_workers_bound(EngineSettings(cpu_binding="nobind")):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_a_binding_that_is_not_one_is_refused():
    from pydantic import ValidationError

    from serving.settings import EngineSettings

    with pytest.raises(ValidationError, match="cpu_binding"):
        EngineSettings(cpu_binding="all the cores")
