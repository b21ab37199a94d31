"""The Ray Serve application: an API ingress (FastAPI) in front of vLLM model replicas.

    Ingress (FastAPI, @serve.ingress) --handle--> ModelReplica x N (one vLLM AsyncLLM each)

The same code runs on a local Ray (`serve.ray_address` empty) and on a Ray cluster
(`ray://head:10001` or `auto`); replica count, engine arguments and resources come from
the `[serve]` section. Replicas hold one model version each; the ingress routes each user
to a version (sticky by user hash) and records every completion to Kafka.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

from ray import serve
from ray.serve.handle import DeploymentHandle

from serving.api import ApiState, build_app, install
from serving.replica import GenerateRequest, GenerateResult
from serving.routing import Split
from serving.settings import ServingSettings

log = logging.getLogger(__name__)

APP_NAME = "flywheel"


@serve.deployment(name="replica")
class ModelReplica:
    """One vLLM engine on one exported model version."""

    def __init__(self, model_dir: str, settings: ServingSettings, version: int):
        from learner.store import default_store_uri
        from serving.hotswap import HotSwapper
        from serving.replica import load_service

        self.service = load_service(Path(model_dir), settings.serve, version)
        self.swapper = HotSwapper(self.service, default_store_uri(settings))  # gates admission from now on

    async def complete(self, req: GenerateRequest) -> GenerateResult:
        return await self.service.complete(req)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        async for r in self.service.stream(req):
            yield r

    def version(self) -> int:
        return self.service.version

    # --- hot swap (serving/hotswap.py) ---------------------------------------------------------

    async def swap_to(self, version: int) -> dict:
        """Swap the weights in place to `version` of the weight store; the report says ok, or why not."""
        return await self.swapper.swap_report(version)

    def swap_status(self) -> dict:
        """Served version, swap counts and the last swap's report or error."""
        return self.swapper.status()


class RayReplica:
    """`ReplicaClient` over a Ray Serve deployment handle."""

    def __init__(self, handle: DeploymentHandle):
        self.handle = handle

    async def complete(self, req: GenerateRequest) -> GenerateResult:
        return await self.handle.complete.remote(req)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        async for r in self.handle.options(stream=True).stream.remote(req):
            yield r


@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress(build_app)  # built inside the replica process, so `install` reaches its routes
class Ingress:
    def __init__(self, settings: ServingSettings, replicas: dict[int, DeploymentHandle], stable: int, tokenizer_dir: str):
        from feedback.producer import BufferedProducer
        from learner.tokenizer import load_tokenizer

        cfg = settings.serve
        tok = load_tokenizer(tokenizer_dir)
        self.producer = BufferedProducer(settings.kafka, max_buffered=cfg.producer_buffer)
        install(
            ApiState(
                cfg=cfg,
                replicas={v: RayReplica(h) for v, h in replicas.items()},
                split=Split(stable=stable),
                producer=self.producer,
                editor_tokens=cfg.editor_tokens(),
                decode=tok.decode,
            )
        )

    def __del__(self):
        producer = getattr(self, "producer", None)
        if producer is not None:
            producer.close(timeout_s=5)


def build(settings: ServingSettings, model_dir: Path, version: int):
    """The bound application, ready for `serve.run`."""
    eng = settings.serve.engine
    replica = ModelReplica.options(
        name=f"replica-v{version}",
        num_replicas=settings.serve.replicas,
        ray_actor_options={"num_cpus": eng.num_cpus, "num_gpus": eng.num_gpus},
    ).bind(str(model_dir), settings, version)
    return Ingress.bind(settings, {version: replica}, version, str(model_dir))


def start(settings: ServingSettings, model_dir: Path, version: int, progress=lambda msg: None) -> str:
    """Start (or join) Ray, deploy the app, and return the API's base URL once it answers."""
    import ray

    cfg = settings.serve
    if not ray.is_initialized():
        progress("starting Ray" if not cfg.ray_address else f"joining Ray at {cfg.ray_address}")
        ray.init(
            address=cfg.ray_address or None,
            num_cpus=None if cfg.ray_address else cfg.ray_num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": str(max(1, int(cfg.engine.kv_cache_gib)))}},
        )
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    progress(f"deploying model v{version} from {model_dir} ({cfg.replicas} replica(s); vLLM start-up takes ~30 s)")
    serve.run(build(settings, model_dir, version), name=APP_NAME, route_prefix="/", blocking=False)
    progress("warming up the engine (vLLM's first step is slow)")
    warm_up(version, cfg.replicas)
    return f"http://{cfg.host}:{cfg.port}"


def warm_up(version: int, replicas: int) -> None:
    """One tiny request per replica, so no user pays for vLLM's first step (~15 s on a CPU)."""
    import asyncio

    from serving.engine import SamplingSpec

    handle = serve.get_deployment_handle(f"replica-v{version}", APP_NAME)
    req = GenerateRequest(completion_id="warmup", prefix="def main():\n    ", suffix="\n", header="", spec=SamplingSpec(max_tokens=2, temperature=0.0))

    async def all_replicas():
        await asyncio.gather(*(handle.complete.remote(req) for _ in range(replicas)))

    asyncio.run(all_replicas())


def stop() -> None:
    import ray

    serve.shutdown()
    ray.shutdown()
