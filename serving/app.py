"""The Ray Serve application: an API ingress (FastAPI) in front of two pools of vLLM replicas.

    Ingress (FastAPI, @serve.ingress) --handle--> replica-stable: ModelReplica x serve.replicas
                                      --handle--> replica-canary: ModelReplica x serve.canary_replicas

The same code runs on a local Ray (`serve.ray_address` empty) and on a Ray cluster
(`ray://head:10001` or `auto`); replica counts, engine arguments and resources come from
the `[serve]` section. Both pools start from the same model folder and version. Which
version each pool should serve, and the canary's share of users, live in SQL
(feedback/pools.py): every replica polls its pool's target and hot-swaps itself in place
(`PoolReconciler`), and the ingress polls the same table to route users (serving/http/routing.py),
so whoever decides (the rollout controller, `flywheel swap`) only writes a row.

The ingress serves serving's own routes (serving/http) and the route groups its caller passes
in as router factories: plain importable functions returning an APIRouter (`flywheel serve`
passes the ops dashboard's and the rollout routes'). Ray pickles them by reference and the
ingress calls them in its replica, where it builds its FastAPI app, so this module never
imports the route groups it serves.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

from fastapi import APIRouter, FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from feedback import pools
from feedback.core.errors import first_line
from serving.http.app import build_app
from serving.http.deps import ApiState
from serving.http.routing import RoutingState, poll_routing
from serving.replica import GenerateRequest, GenerateResult
from serving.settings import EngineSettings, ServeSettings, ServingSettings

log = logging.getLogger(__name__)

RouterFactory = Callable[[], APIRouter]
"""A route group for the ingress's app: an importable function (Ray pickles it by reference)."""

APP_NAME = "flywheel"


def deployment_name(pool: str) -> str:
    return f"replica-{pool}"


def pool_sizes(cfg: ServeSettings) -> dict[str, int]:
    """Replicas per pool; a pool of 0 replicas is not deployed."""
    return {p: n for p, n in ((pools.STABLE, cfg.replicas), (pools.CANARY, cfg.canary_replicas)) if n > 0}


# --- keeping a replica on its pool's target ---------------------------------------------------------


class PoolReconciler:
    """Keeps one replica on its pool's target version. Each `step` reads the targets
    (`pools.read`), and when the pool's target is set and differs from the version served,
    swaps in place (`HotSwapper.swap_report`) and logs the attempt in `swap_events`.

    A target whose swap failed is not retried at once: a corrupt or missing version stays so
    for a while, and each attempt fetches the deltas again. It is retried after `retry_s`,
    then twice as long each time, up to `max_retry_s`; a different target is tried at once.
    Database errors are logged (once per distinct error) and leave the replica serving what
    it serves. Plain asyncio, no Ray: `ModelReplica` runs `run()` on its event loop."""

    def __init__(
        self,
        engine,
        *,
        pool: str,
        replica: str,
        swapper,
        retry_s: float = 30.0,
        max_retry_s: float = 900.0,
        clock=time.monotonic,
    ):
        assert pool in pools.POOLS, pool
        self.engine, self.pool, self.replica, self.swapper = engine, pool, replica, swapper
        self.retry_s, self.max_retry_s, self.clock = retry_s, max_retry_s, clock
        self.target: int | None = None  # the pool's target at the last read
        self.failed_target: int | None = None
        self.failures = 0  # consecutive failed attempts at `failed_target`
        self.retry_at = 0.0  # clock() time after which `failed_target` may be tried again
        self.db_error: str | None = None
        self.polled_at: float | None = None  # wall time of the last successful read

    def status(self) -> dict:
        waiting = self.failed_target is not None and self.failed_target == self.target
        return {
            "pool": self.pool,
            "replica": self.replica,
            "target": self.target,
            "failed_target": self.failed_target,
            "consecutive_failures": self.failures,
            "retry_in_s": round(max(0.0, self.retry_at - self.clock()), 1) if waiting else None,
            "db_error": self.db_error,
            "polled_at": self.polled_at,
        }

    async def step(self) -> dict | None:
        """One poll; the swap report (a dict) if it tried a swap, else None."""
        try:
            routes = await asyncio.to_thread(pools.read, self.engine)
        except Exception as e:
            self._db_failed("reading the serving targets (serving_pools)", e)
            return None
        self._db_ok()
        target = self.target = routes.target(self.pool)
        if target is None or target == self.swapper.service.version:
            return None
        if target == self.failed_target and self.clock() < self.retry_at:
            return None
        report = await self.swapper.swap_report(target)
        if report["ok"]:
            self.failed_target, self.failures = None, 0
        else:
            self.failures = self.failures + 1 if target == self.failed_target else 1
            self.failed_target = target
            wait = min(self.retry_s * 2 ** (self.failures - 1), self.max_retry_s)
            self.retry_at = self.clock() + wait
            log.warning(
                "%s pool replica %s: %s; retrying v%d in %.0f s", self.pool, self.replica, report["error"], target, wait
            )
        try:
            await asyncio.to_thread(pools.record_swap, self.engine, pool=self.pool, replica=self.replica, report=report)
        except Exception as e:
            self._db_failed("recording the swap (swap_events)", e)
        return report

    async def run(self, interval_s: float) -> None:
        """Warm the swap path, then poll forever; nothing that goes wrong in a step stops the
        loop (or the replica)."""
        try:
            await self.swapper.warm()
        except Exception:
            log.exception("%s pool replica %s: warming the swap path failed", self.pool, self.replica)
        while True:
            try:
                await self.step()
            except Exception:
                log.exception("%s pool replica %s: reconcile step failed", self.pool, self.replica)
            await asyncio.sleep(interval_s)

    def _db_failed(self, what: str, e: Exception) -> None:
        msg = f"{what} failed: {first_line(e)}"
        if msg != self.db_error:  # once per distinct error, not once per poll
            log.error(
                "%s pool replica %s: %s (is the database migrated? `flywheel db upgrade`)", self.pool, self.replica, msg
            )
        self.db_error = msg

    def _db_ok(self) -> None:
        if self.db_error is not None:
            log.info("%s pool replica %s: the database answers again", self.pool, self.replica)
        self.db_error, self.polled_at = None, time.time()


def _node_id() -> str | None:
    """The Ray node this process runs on; None outside Ray."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.to_full_id_str()[:128]
    except Exception:  # not inside a Ray Serve replica
        return f"local-{uuid.uuid4().hex[:12]}"


# --- the deployments ------------------------------------------------------------------------------


@serve.deployment(name="replica")
class ModelReplica:
    """One vLLM engine in a pool (stable or canary), kept on the pool's target version."""

    def __init__(self, model_dir: str, settings: ServingSettings, version: int, pool: str):
        from feedback.db import make_engine
        from learner.store import settings_store
        from serving.hotswap import HotSwapper
        from serving.model_source import node_settings, replica_model_folder
        from serving.replica import load_service

        self.pool = pool
        node = node_settings(settings)  # this node's own folders (serve.replica_dir)
        store = settings_store(node)  # this replica's own payload cache
        model_dir = str(replica_model_folder(settings, store, version, model_dir, node))
        self.where = {"node_id": _node_id(), "model_dir": model_dir, "store_cache_dir": str(node.store_cache_dir)}
        self.completions: dict[int, int] = {}  # completions answered, by the version that answered them
        self.service = load_service(
            Path(model_dir),
            settings.serve,
            version,
            fim=settings.model.fim,
            min_confidence=settings.model.min_confidence,
        )
        if version in store.versions():  # the show policy learned with it (learner/show.py)
            self.service.show_policy = store.show_policy(version)
        preempt = settings.serve.swap_preempt_after_ms
        self.swapper = HotSwapper(  # gates admission from now on
            self.service,
            store,
            loaded_from=model_dir,
            pool=pool,
            preempt_after_s=preempt / 1000 if preempt >= 0 else None,
        )
        self.reconciler = PoolReconciler(
            make_engine(settings.database_url), pool=pool, replica=_replica_id(), swapper=self.swapper
        )
        self._poll_s = settings.serve.pool_poll_s
        self._reconciling: asyncio.Task | None = None
        self._ensure_reconciling()

    def _ensure_reconciling(self) -> None:
        """Run the reconcile loop on this replica's event loop. Ray Serve calls __init__ on it
        (so the loop starts with the replica); elsewhere the first async call starts it."""
        if self._reconciling is not None and not self._reconciling.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._reconciling = loop.create_task(self.reconciler.run(self._poll_s), name=f"reconcile-{self.pool}")

    async def complete(self, req: GenerateRequest) -> GenerateResult:
        self._ensure_reconciling()
        return self._answered(await self.service.complete(req))

    async def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        self._ensure_reconciling()
        async for r in self.service.stream(req):
            yield self._answered(r) if r.done else r

    def _answered(self, r: GenerateResult) -> GenerateResult:
        self.completions[r.model_version] = self.completions.get(r.model_version, 0) + 1
        return r

    def version(self) -> int:
        """The version served; an error while out of service (the ingress then routes no canary or
        pinned users here: serving/http/routing.py)."""
        if self.swapper.out_of_service:
            raise RuntimeError(f"out of service: {self.swapper.out_of_service}")
        return self.service.version

    def check_health(self) -> None:
        """Ray Serve's periodic health check: a replica whose weights are mixed after a broken-off
        reload (serving/hotswap.py) fails it, and Ray Serve replaces it with a fresh one."""
        if self.swapper.out_of_service:
            raise RuntimeError(f"out of service: {self.swapper.out_of_service}")

    # --- hot swap (serving/hotswap.py) ---------------------------------------------------------

    async def swap_to(self, version: int) -> dict:
        """Swap the weights in place to `version` of the weight store; the report says ok, or why not.
        The reconcile loop swaps back to the pool's target (if one is set) on its next poll."""
        self._ensure_reconciling()
        return await self.swapper.swap_report(version)

    def swap_status(self) -> dict:
        """Served version, swap counts, the last swap's report or error, the reconcile state (the
        pool's target, a failing target and when it is retried, a database error), where this
        replica runs (its Ray node, the folder it loaded, its payload cache) and how many
        completions each version answered here."""
        return self.swapper.status() | {
            "pool": self.pool,
            "reconcile": self.reconciler.status(),
            "replica": self.reconciler.replica,
            **self.where,
            "completions": dict(self.completions),
        }


class RayReplica:
    """`ReplicaClient` over a Ray Serve deployment handle (one pool)."""

    def __init__(self, handle: DeploymentHandle):
        self.handle = handle

    async def complete(self, req: GenerateRequest) -> GenerateResult:
        return await self.handle.complete.remote(req)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]:
        async for r in self.handle.options(stream=True).stream.remote(req):
            yield r

    async def served_version(self) -> int:
        # One replica of the pool answers: a sample, see serving.http.routing.RoutingState.
        return await self.handle.version.remote()


# The ingress awaits replicas and the producer: what bounds a request is the pool's queue
# (serve.max_queued_requests), not a cap here, so it takes what the proxy sends it (Ray Serve
# LLM's ingress does the same).
@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress()  # the app is built in the replica, after __init__: __serve_build_asgi_app__
class Ingress:
    def __init__(
        self,
        settings: ServingSettings,
        replicas: dict[str, DeploymentHandle],
        tokenizer_dir: str,
        routers: Sequence[RouterFactory] = (),
    ):
        from feedback.db import make_engine
        from feedback.producer import BufferedProducer
        from learner.formats import read_format
        from learner.tokenizer import load_tokenizer

        cfg = settings.serve
        tok = load_tokenizer(tokenizer_dir)
        prompt_format = read_format(tokenizer_dir, fim=settings.model.fim).describe()
        self.producer = BufferedProducer(settings.kafka, max_buffered=cfg.producer_buffer)
        self.state = ApiState(
            cfg=cfg,
            replicas={pool: RayReplica(h) for pool, h in replicas.items()},
            routing=RoutingState(),
            producer=self.producer,
            editor_tokens=cfg.editor_tokens(),
            token_users=cfg.editor_token_users(),
            decode=tok.decode,
            ops_tokens=cfg.ops_token_set(),
            database_url=settings.database_url,  # the ops routes' database (app.state.database_url)
            prompt_format=prompt_format,
        )
        self.routers = tuple(routers)
        engine = make_engine(settings.database_url)
        # Ray Serve runs __init__ on the replica's event loop, where the routes run too.
        self._poller = asyncio.get_running_loop().create_task(
            poll_routing(self.state, lambda: pools.read(engine), cfg.pool_poll_s)
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The ingress's app: serving's routes and the route groups passed in, over this replica's state."""
        app = build_app(routers=[make() for make in self.routers])
        app.state.api = self.state
        return app

    def __del__(self):
        producer = getattr(self, "producer", None)
        if producer is not None:
            producer.close(timeout_s=5)


def replica_options(eng: EngineSettings, max_per_node: int | None = None) -> dict:
    """Ray Serve options for one model replica's resources and placement.

    One worker, or `mp` workers (the replica's child processes): the replica's actor holds them all,
    and `max_per_node` (serve.max_replicas_per_node) caps a pool's replicas on one node.
    `ray` workers: a placement group per replica, one GPU bundle per worker, the replica's own CPUs
    in the first bundle beside worker 0 (Ray Serve puts the replica in bundle 0), as Ray Serve LLM
    places vLLM; `placement_strategy` says whether the bundles may span nodes (Ray Serve takes no
    `max_per_node` beside a placement group: ServeSettings refuses the pair)."""
    if eng.executor != "ray" or eng.world_size == 1:
        spread = {} if max_per_node is None else {"max_replicas_per_node": max_per_node}
        return {"ray_actor_options": {"num_cpus": eng.num_cpus, "num_gpus": eng.num_gpus * eng.world_size}} | spread
    assert max_per_node is None, "ServeSettings refuses max_replicas_per_node beside placement groups"
    first = {"CPU": eng.num_cpus, "GPU": 1.0} if eng.num_cpus else {"GPU": 1.0}  # Ray refuses a 0 in a bundle
    bundles = [first] + [{"GPU": 1.0} for _ in range(eng.world_size - 1)]
    return {
        "ray_actor_options": {"num_cpus": eng.num_cpus, "num_gpus": 0},
        "placement_group_bundles": bundles,
        "placement_group_strategy": eng.placement_strategy,
    }


def queue_options(cfg: ServeSettings) -> dict:
    """How many requests Ray Serve lets one model replica hold, and how many wait for one: the
    engine batches what it holds, and a completion beyond the queue gets 503 at once (serving/http/
    completions.py: replica_error) instead of waiting behind the others."""
    return {
        "max_ongoing_requests": cfg.max_ongoing_requests or cfg.engine.max_num_seqs,
        "max_queued_requests": cfg.max_queued_requests,
    }


def build(settings: ServingSettings, model_dir: Path, version: int, routers: Sequence[RouterFactory] = ()):
    """The bound application, ready for `serve.run`: both pools start on `version` of `model_dir`;
    the ingress serves serving's routes and those of `routers`."""
    cfg = settings.serve
    handles = {
        pool: ModelReplica.options(
            name=deployment_name(pool),
            num_replicas=n,
            **queue_options(cfg),
            **replica_options(cfg.engine, cfg.max_replicas_per_node),
            logging_config=logging_config(cfg),
        ).bind(str(model_dir), settings, version, pool)
        for pool, n in pool_sizes(settings.serve).items()
    }
    return Ingress.options(logging_config=logging_config(cfg)).bind(settings, handles, str(model_dir), tuple(routers))


def logging_config(cfg: ServeSettings) -> dict:
    """Ray Serve's logging for the proxy and the deployments: its access log only if asked for
    (`serve.access_log`)."""
    return {"enable_access_log": cfg.access_log}


def start(
    settings: ServingSettings,
    model_dir: Path,
    version: int,
    progress=lambda msg: None,
    *,
    routers: Sequence[RouterFactory] = (),
) -> str:
    """Start (or join) Ray, deploy the app, and return the API's base URL once it answers. The API
    serves serving's routes and those of `routers` (factories, see `RouterFactory`)."""
    import ray

    settings = settings.with_user_hash_secret()
    cfg = settings.serve
    migrate(settings, version, progress)
    if not ray.is_initialized():
        progress("starting Ray" if not cfg.ray_address else f"joining Ray at {cfg.ray_address}")
        if not cfg.ray_address:
            _patient_local_serve()
        try:
            ray.init(
                address=cfg.ray_address or None,
                num_cpus=None if cfg.ray_address else cfg.ray_num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                _metrics_export_port=None if cfg.ray_address else cfg.ray_metrics_port,
                runtime_env={
                    "env_vars": {"VLLM_CPU_KVCACHE_SPACE": str(max(1, int(cfg.engine.kv_cache_gib))), **_passed_env()}
                },
            )
        except ConnectionError as e:
            if not cfg.ray_address:
                raise
            from feedback.core.errors import UserError

            # Ray's own cause (a refused token, no GCS) is a multi-line message with a traceback in it
            raise UserError(
                f"cannot join the Ray cluster at serve.ray_address {cfg.ray_address}: {first_line(e)} (is it up? a "
                "cluster with Ray's token authentication needs RAY_AUTH_MODE=token and its token in RAY_AUTH_TOKEN here)"
            ) from None
    if not cfg.ray_address:
        settings = with_local_precision(settings, progress)
        cfg = settings.serve
    if urls := replica_metrics_urls():
        progress(f"replica metrics (hot swaps, vLLM) for Prometheus: {', '.join(urls)}")
    serve.start(http_options={"host": cfg.host, "port": cfg.port}, logging_config=logging_config(cfg))
    sizes = pool_sizes(cfg)
    where = ", ".join(f"{n} {pool}" for pool, n in sizes.items())
    progress(f"deploying model v{version} from {model_dir} ({where} replica(s); vLLM start-up takes ~30 s)")
    serve.run(build(settings, model_dir, version, routers), name=APP_NAME, route_prefix="/", blocking=False)
    progress("warming up the engines (vLLM's first step is slow)")
    warm_up(sizes)
    return f"http://{cfg.host}:{cfg.port}"


# A local Ray started here is tuned for a machine it shares with other work; a cluster that
# Flywheel joins keeps its own settings.
#  - Ray runs its workers at niceness 15, to keep its own daemons responsive. Our workers are the
#    model replicas, the ingress and the HTTP proxy: at nice 15 next to any busy process at nice 0
#    they get a few percent of a core (measured: vLLM replicas took over 10 minutes to start
#    beside two CPU-bound processes). Serving must not be the first thing to starve.
#  - Ray Serve kills an HTTP proxy that is not ready within 3 x 5 s, and `serve.start` then fails
#    with a dead actor; on a loaded 2-core machine the proxy can take longer to import its modules.
_LOCAL_SERVE_ENV = {
    "RAY_worker_niceness": "0",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}


def replica_metrics_urls() -> list[str]:
    """Where Ray's metrics agents export what the replicas record (serving/metrics.py): one URL
    per live node of the cluster."""
    import ray

    return [
        f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
        for n in ray.nodes()
        if n.get("Alive") and n.get("MetricsExportPort")
    ]


def _patient_local_serve() -> None:
    """Inherited by the local Ray's processes (the Serve controller reads them at start)."""
    import os

    for k, v in _LOCAL_SERVE_ENV.items():
        os.environ.setdefault(k, v)


def with_local_precision(settings: ServingSettings, progress=lambda msg: None) -> ServingSettings:
    """`settings` with `serve.engine.dtype` decided once for this machine. Every replica of a local
    Ray runs here, and each would otherwise measure on its own: where bf16 is about as slow as the
    threshold allows, the measurements differ and the stable and canary pools would compute in
    different dtypes, which the rollout's latency comparison would then blame on the version.
    GPU replicas keep their own choice: it follows the device, not a measurement, and this
    process may not see the GPUs Ray gives them."""
    precision = engine_precision(settings.serve)
    progress(f"vLLM dtype: {precision}")
    if settings.serve.engine.num_gpus > 0:
        return settings
    engine = settings.serve.engine.model_copy(update={"dtype": precision.dtype})
    return settings.model_copy(update={"serve": settings.serve.model_copy(update={"engine": engine})})


def engine_precision(cfg: ServeSettings):
    """The dtype replicas on this machine choose for `serve.engine.dtype` (each replica decides on its own host)."""
    from feedback.core.precision import resolve

    return resolve(cfg.engine.dtype, device="cuda" if cfg.engine.num_gpus > 0 else "cpu", setting="serve.engine.dtype")


def _passed_env() -> dict[str, str]:
    """Settings that replicas read from the environment, passed on to Ray's workers."""
    import os

    from feedback.core.precision import ENV_OVERRIDE

    return {k: os.environ[k] for k in (ENV_OVERRIDE,) if k in os.environ}


def migrate(settings: ServingSettings, version: int | None = None, progress=lambda msg: None) -> None:
    """Bring the database up to date (idempotent, as the sink does): the pools poll `serving_pools`.
    With no stable target recorded yet, record the deployed `version` as stable, so the rollout
    controller knows what a candidate is compared with. Serving does not need the database to
    answer, so an unreachable one is only reported."""
    from feedback import db, pools
    from feedback.core.errors import UserError

    try:
        engine = db.make_engine(settings.database_url)
        db.upgrade(engine)
        if version is not None and pools.read(engine).stable is None:
            pools.set_stable(engine, version)
    except UserError as e:
        log.warning("%s; pools keep their deployed version until it answers", e)
        progress(f"warning: {e}")


def warm_up(sizes: dict[str, int]) -> None:
    """One tiny request per replica of each pool, so no user pays for vLLM's first step (~15 s on
    a CPU). The router picks replicas, so this warms each one only as far as it spreads requests."""
    from serving.engine import SamplingSpec

    spec = SamplingSpec(max_tokens=2, temperature=0.0)

    async def all_replicas():
        calls = []
        for pool, n in sizes.items():
            handle = serve.get_deployment_handle(deployment_name(pool), APP_NAME)
            for i in range(n):  # request ids unique per engine, as vLLM expects
                calls.append(
                    handle.complete.remote(GenerateRequest(f"warmup-{pool}-{i}", "def main():\n    ", "\n", None, spec))
                )
        await asyncio.gather(*calls)

    asyncio.run(all_replicas())


def stop() -> None:
    import ray

    serve.shutdown()
    ray.shutdown()
