"""`[serve.engine]` parallelism and quantization: what each executor can place, refused in one line."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving.settings import EngineSettings


def test_one_worker_is_the_default_and_runs_in_process():
    eng = EngineSettings()
    assert (eng.world_size, eng.executor, eng.quantization) == (1, "uni", None)


def test_world_size_is_tensor_times_pipeline_times_data_parallel():
    eng = EngineSettings(executor="mp", tensor_parallel_size=2, pipeline_parallel_size=3, data_parallel_size=2)
    assert eng.world_size == 12


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"tensor_parallel_size": 2}, 'need executor = "mp"'),
        ({"pipeline_parallel_size": 2, "executor": "ray"}, 'on CPUs use executor = "mp"'),
        ({"tensor_parallel_size": 2, "executor": "ray", "num_gpus": 0.5}, "exactly one GPU"),
        ({"enable_expert_parallel": True}, "tensor_parallel_size or data_parallel_size above 1"),
        ({"quantization": "FP8; rm"}, "quantization"),
        ({"placement_strategy": "ANYWHERE"}, "placement_strategy"),
    ],
)
def test_what_an_executor_cannot_place_is_refused_saying_what_to_set(kwargs, says):
    with pytest.raises(ValidationError, match=says):
        EngineSettings(**kwargs)


def test_expert_parallel_over_tensor_parallel_workers_is_accepted():
    eng = EngineSettings(executor="ray", num_gpus=1, tensor_parallel_size=4, enable_expert_parallel=True)
    assert eng.world_size == 4 and eng.enable_expert_parallel


def test_max_replicas_per_node_is_refused_beside_replica_placement_groups():
    from serving.settings import ServeSettings

    with pytest.raises(ValidationError, match="max_replicas_per_node cannot be combined with replica placement groups"):
        ServeSettings(max_replicas_per_node=1, engine={"executor": "ray", "num_gpus": 1, "tensor_parallel_size": 2})
    with pytest.raises(ValidationError, match="max_replicas_per_node"):
        ServeSettings(max_replicas_per_node=0)
    # one model worker per replica (or mp workers inside it): no placement group, Ray Serve spreads them
    assert ServeSettings(max_replicas_per_node=1, engine={"executor": "mp", "tensor_parallel_size": 2})
