"""How a model replica asks Ray Serve for its resources (serving/app.py: replica_options)."""

from __future__ import annotations

from serving.app import replica_options
from serving.settings import EngineSettings


def test_one_worker_holds_its_resources_in_the_replica_actor():
    assert replica_options(EngineSettings(num_cpus=2, num_gpus=0.5)) == {
        "ray_actor_options": {"num_cpus": 2, "num_gpus": 0.5}
    }


def test_mp_workers_are_children_of_the_replica_so_it_holds_every_gpu():
    eng = EngineSettings(executor="mp", num_gpus=1, tensor_parallel_size=4)
    assert replica_options(eng) == {"ray_actor_options": {"num_cpus": 1, "num_gpus": 4}}


def test_ray_workers_get_one_gpu_bundle_each_with_the_replica_in_the_first():
    eng = EngineSettings(
        executor="ray",
        num_gpus=1,
        num_cpus=2,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        placement_strategy="PACK",
    )
    opts = replica_options(eng)
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0}
    assert opts["placement_group_bundles"] == [{"CPU": 2, "GPU": 1.0}] + [{"GPU": 1.0}] * 3
    assert opts["placement_group_strategy"] == "PACK"
    # vLLM's Ray executor counts bundles holding exactly one GPU and needs one per worker
    assert sum(b.get("GPU", 0) == 1 for b in opts["placement_group_bundles"]) == eng.world_size


def test_a_replica_without_cpus_of_its_own_puts_no_zero_in_a_bundle():
    eng = EngineSettings(executor="ray", num_gpus=1, num_cpus=0, tensor_parallel_size=2)
    assert all(v > 0 for b in replica_options(eng)["placement_group_bundles"] for v in b.values())


def test_a_pool_spreads_over_nodes_with_max_replicas_per_node():
    assert replica_options(EngineSettings(), max_per_node=1) == {
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 0},
        "max_replicas_per_node": 1,
    }
    assert "max_replicas_per_node" not in replica_options(EngineSettings())  # unset: Ray Serve packs


def test_a_replica_holds_what_its_engine_batches_and_the_queue_is_bounded():
    from serving.app import queue_options
    from serving.settings import ServeSettings

    # Ray Serve's own default (5 ongoing) would queue requests in front of an engine with room.
    assert queue_options(ServeSettings()) == {"max_ongoing_requests": 64, "max_queued_requests": 64}
    cfg = ServeSettings(engine=EngineSettings(max_num_seqs=16), max_queued_requests=-1)
    assert queue_options(cfg) == {"max_ongoing_requests": 16, "max_queued_requests": -1}
    assert queue_options(ServeSettings(max_ongoing_requests=8))["max_ongoing_requests"] == 8


def test_a_queue_limit_of_zero_is_refused_as_ray_serve_would():
    import pytest
    from pydantic import ValidationError

    from serving.settings import ServeSettings

    with pytest.raises(ValidationError, match="max_queued_requests"):
        ServeSettings(max_queued_requests=0)


def test_ray_serve_access_log_is_off_unless_asked_for():
    from serving.app import logging_config
    from serving.settings import ServeSettings

    assert logging_config(ServeSettings()) == {"enable_access_log": False}
    assert logging_config(ServeSettings(access_log=True)) == {"enable_access_log": True}


def test_a_local_ray_decides_the_engine_dtype_once_for_every_replica(monkeypatch):
    # Each replica measuring on its own can land on either side of the bf16 threshold.
    from feedback.core.precision import Precision
    from serving import app
    from serving.settings import ServingSettings

    calls = []

    def measured(cfg):
        calls.append(cfg.engine.dtype)
        return Precision("float32", "bf16 2.02x slower")

    monkeypatch.setattr(app, "engine_precision", measured)
    said = []
    given = ServingSettings()
    s = app.with_local_precision(given, said.append)
    assert s.serve.engine.dtype == "float32" and calls == ["auto"]
    assert said == ["vLLM dtype: float32 (bf16 2.02x slower)"]
    assert given.serve.engine.dtype == "auto"  # a copy: the settings given are not changed
    gpu = ServingSettings(serve={"engine": {"num_gpus": 1}})
    assert app.with_local_precision(gpu).serve.engine.dtype == "auto"  # follows the device, decided there
