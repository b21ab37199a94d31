"""Hot swap: move a serving replica from version N to a newer one in place, without a restart.

    HotSwapper.swap_to(target)                                      (replica process)
      1. plan     store.plan(target, have=N): the deltas after N, or the nearest full
                  snapshot and the deltas after it when N is unknown, not an ancestor, or
                  further back than a snapshot is big (learner.store)
      2. fetch    download them (kept in the replica's own payload cache, `store.cache_dir`),
                  decode and apply them, verifying the base digest, every touched
                  tensor and the result against the target's manifest (learner.delta); a
                  corrupt or mismatched delta stops here, before the engine is touched
      3. write    the tensors whose hash changed, widened to whole vLLM layers (`reload_set`),
                  as the bf16 tensors vLLM loads (learner.store.to_hf_tensors), into one
                  safetensors file in a temp folder
      4. stage    the vLLM worker (WeightSwapExtension, via collective_rpc with the file's path,
                  never tensors) reads the file, checks its sha256 and parses it, and keeps the
                  tensors; a file that fails its check stops the swap here. Then a thread in the
                  worker loads them into a shadow of the model and processes them into the
                  kernels' layout (serving/reload.py, `engine.prepared_reload`)
      5. pause    close admission, let in-flight requests finish (drain), then inside the
                  worker copy the prepared tensors into the live ones; or, where the preparation
                  failed or is off, `reload_weights` the staged tensors the vLLM way and prepack
                  reloaded CPU experts again (`_repack_cpu_experts`); switch
                  `CompletionService.version` and reopen admission
    Steps 1-3 run in a thread while the replica keeps serving N, step 4's read between two of the
    engine's steps and its preparation beside them; only step 5 pauses it.

Admission closes at the replica's engine (`GatedEngine`): requests that arrive during the
pause wait, then run on N+1. In-flight requests get `preempt_after_s` (`serve.swap_preempt_after_ms`)
to finish on the old weights. Then those whose client has seen nothing yet (every non-streamed
request, a stream before its first token) are aborted in the engine and run again, whole, on
N+1 once it is loaded: counted in `flywheel_swap_restarts_total`. A stream that has sent tokens
always finishes on N. A request's tokens therefore all come from one version, and the version
a result carries is the one that produced it: outputs are only produced while no swap is in
progress. (vLLM's own `pause_generation(mode="keep")` would make the pause shorter still, but a
frozen request would then continue on new weights over a KV cache built by the old ones: tokens
of neither version.) The pause is the wait (at most `preempt_after_s`, or the longest stream in
flight) plus the reload; without preemption (`preempt_after_s` None) it was the longest request
in flight, which under load is the slowest completion, seconds on a busy CPU.

A failed swap (bad plan, corrupt delta, checksum mismatch, drain timeout, worker error)
leaves the replica on N: it is logged, kept in `last_swap_error` and counted in
`flywheel_swaps_total{outcome="failed"}` (an object of the store that fails its sha256, named in
the error, also in `flywheel_store_corrupt_objects_total`); `flywheel_swap_pause_seconds` records each pause,
both by pool. Should
the reload fail inside the worker after it began, the engine may hold some tensors of each
version, so the replica puts N's tensors back: from the checkpoint it keeps, or before its
first swap (when it keeps none) from the model folder the engine loaded. If it cannot (no
folder, or that reload fails too), it never serves those mixed weights under N's name: it
goes out of service (`out_of_service`): admission refuses every request (the ingress answers
503), `ModelReplica.check_health` fails so Ray Serve replaces it, and `version` does not
answer, so the ingress sends it no canary or pinned users. A later swap that reloads every
tensor successfully brings it back. Measured with vLLM 0.32 on a CPU: after a reload broke
off, the worker refused every later reload (the old tensors too), so there a replica goes out
of service and Ray Serve's restart is what brings it back.

The replica keeps the packed checkpoint of the version it serves (the FP4 form: about a
third of bf16), so the next swap is a delta away. Until its first swap it does not know
that its weights equal any stored version (it was started from a model folder), so that
first swap reloads every tensor; `adopt(version)` declares the weights equal to a stored
version instead.

Who calls `swap_to`: each replica's `PoolReconciler` (serving/app.py), when its pool's target
version in `serving_pools` changes (feedback/pools.py); the rollout controller or `flywheel
swap` set the targets. Every attempt is logged in `swap_events`. The metrics live in the
process that swaps (each Ray Serve replica), so they are recorded through Ray's metrics and
exported by Ray's metrics agent as `ray_flywheel_...` (serving/metrics.py: ReplicaMetric),
not in the ingress's /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import re
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from serving.metrics import ReplicaMetric

if TYPE_CHECKING:
    from learner.show import ShowPolicy

log = logging.getLogger(__name__)

# outcome: ok | failed (a failed swap leaves the replica on its version); pool: stable | canary
SWAPS = ReplicaMetric("counter", "flywheel_swaps_total", "In-place weight swaps by outcome", ("pool", "outcome"))
SWAP_PAUSE = ReplicaMetric(
    "histogram",
    "flywheel_swap_pause_seconds",
    "Time admission was closed for a weight swap (the wait for in-flight requests, then the reload)",
    ("pool",),
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
RESTARTS = ReplicaMetric(
    "counter",
    "flywheel_swap_restarts_total",
    "In-flight requests a weight swap aborted before their client saw anything, and ran again on the new version",
    ("pool",),
)
CORRUPT = ReplicaMetric(
    "counter",
    "flywheel_store_corrupt_objects_total",
    "Objects fetched from the weight store that failed their sha256 check (the swap was refused)",
    ("pool",),
)


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


class SwapError(RuntimeError):
    """A swap that did not happen; the replica still serves its previous version."""


class OutOfService(RuntimeError):
    """The replica's weights are mixed after a reload that broke off: it serves nothing."""


# --- inside the vLLM worker ----------------------------------------------------------------------


class WeightSwapExtension:
    """Mixed into vLLM's worker class (engine argument `worker_extension_cls`), so the engine
    can call `collective_rpc("flywheel_stage_weights" / "flywheel_load_weights", args=(path, sha256))`. Runs in the worker
    process: `self` is vLLM's Worker. After vLLM's reload it redoes what that reload misses on the
    CPU (below): the experts' prepack, a tied output layer's GEMM handle."""

    def flywheel_stage_weights(self, path: str, sha256: str, prepare: bool = False) -> dict:
        """Read the file, check its sha256 and parse it, ahead of `flywheel_load_weights`, which
        then only reloads: called while the replica still serves (it holds the engine's step
        loop for as long as it takes), so the pause does not include it. With `prepare`, a thread
        then builds the new weights in the kernels' layout beside the live model
        (serving/reload.py) while the engine keeps stepping; `flywheel_stage_ready` says when it is
        done, and the load only copies them in."""
        self._flywheel_staged = None
        tensors, nbytes, stages = _read_checked(path, sha256)
        preparation = None
        if prepare:
            from vllm.config import set_current_vllm_config

            from serving.reload import Preparation

            # as vLLM's reload_weights, under the worker's config (the same object the engine's
            # steps see: process-wide in vLLM 0.32, not per thread)
            preparation = Preparation(
                self.model_runner.get_model(), tensors, lambda: set_current_vllm_config(self.vllm_config)
            )
        self._flywheel_staged = (path, sha256, tensors, nbytes, preparation)
        return {"tensors": len(tensors), "bytes": nbytes, "seconds": sum(stages.values()), "stages": stages}

    def flywheel_stage_ready(self) -> dict:
        """Whether the staged file's preparation is done: {"ready": bool, "prepared": bool, "error": str | None}."""
        staged = getattr(self, "_flywheel_staged", None)
        preparation = staged[4] if staged is not None else None
        if preparation is None or not preparation.done:
            return {"ready": preparation is None, "prepared": False, "error": None}
        prepared = preparation.result()
        return {
            "ready": True,
            "prepared": prepared is not None,
            "error": preparation.error,
            "stages": prepared.seconds if prepared is not None else {},
        }

    def flywheel_load_weights(self, path: str, sha256: str) -> dict:
        """Reload the tensors of the safetensors file `path` in place: staged by
        `flywheel_stage_weights` when that was the same file, else read and checked now. A staged
        preparation that finished is copied in (`commit`); otherwise vLLM's reload runs here."""
        staged, self._flywheel_staged = getattr(self, "_flywheel_staged", None), None
        prepared = None
        if staged is not None and staged[:2] == (path, sha256):
            tensors, nbytes, stages, preparation = *staged[2:4], {}, staged[4]
            prepared = preparation.result() if preparation is not None else None
            if preparation is not None and prepared is None:
                log.warning("prepared reload failed (%s); reloading the vLLM way", preparation.error)
        else:
            tensors, nbytes, stages = _read_checked(path, sha256)
        t0 = time.perf_counter()
        if prepared is not None:
            from serving.reload import Unsupported

            try:
                prepared.commit()
            except Unsupported as e:  # checked before the first copy: the live model is unchanged
                log.warning("prepared reload does not fit (%s); reloading the vLLM way", e)
                prepared = None
            else:
                self._flywheel_reset_after_reload()
                return {
                    "tensors": len(tensors),
                    "bytes": nbytes,
                    "seconds": time.perf_counter() - t0,
                    "stages": {"commit": time.perf_counter() - t0},
                    "prepared": True,
                }
        self.reload_weights(weights_iterator=iter(tensors.items()))
        t1 = time.perf_counter()
        _repack_cpu_experts(self.model_runner.get_model(), tensors)
        _refresh_tied_output_layer(self.model_runner.get_model(), tensors)
        stages |= {"reload": t1 - t0, "repack": time.perf_counter() - t1}
        return {
            "tensors": len(tensors),
            "bytes": nbytes,
            "seconds": sum(stages.values()),
            "stages": stages,
            "prepared": False,
        }

    def flywheel_weights_digest(self) -> str:
        """sha256 over every parameter and buffer the worker's model holds, by name, in the kernels'
        layout: equal digests mean two reload paths (or two replicas) hold the same weights."""
        import torch

        h = hashlib.sha256()
        model = self.model_runner.get_model()
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()

    def _flywheel_reset_after_reload(self) -> None:
        """What vLLM's `reload_weights` clears after loading: state derived from the old weights."""
        runner = self.model_runner
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if callable(getattr(runner, reset, None)):
                getattr(runner, reset)()


def _read_checked(path: str, sha256: str) -> tuple[dict, int, dict[str, float]]:
    """The tensors of the safetensors file `path`, refused unless its bytes hash to `sha256`; its
    size; and the seconds spent reading, checking and parsing it."""
    from safetensors.torch import load

    t0 = time.perf_counter()
    data = Path(path).read_bytes()
    t1 = time.perf_counter()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{path}: sha256 mismatch, refusing to load (the file changed after the replica wrote it)")
    t2 = time.perf_counter()
    tensors = load(data)
    return tensors, len(data), {"read": t1 - t0, "sha256": t2 - t1, "parse": time.perf_counter() - t2}


def _repack_cpu_experts(model, names) -> None:
    """Work around vLLM 0.32's CPU MoE reload: its experts keep their weights in a prepacked
    grouped-GEMM layout, but a reload writes checkpoint-layout data into that storage and
    skips the prepack (it is meant to run once). Measured: reloading a layer's unchanged
    expert weights changed greedy tokens. Prepack the reloaded layers again."""
    from serving.reload import cpu_experts

    for prefix in sorted({m.group(1) for n in names if (m := re.match(r"^(.*\.experts)\.\d+\.", n))}):
        for layer in model.get_submodule(prefix).modules():  # the RoutedExperts inside vLLM's MoE runner
            if (experts := cpu_experts(layer)) is not None:
                experts.process_weights_after_loading(layer)


def _refresh_tied_output_layer(model, names) -> None:
    """Work around vLLM 0.32's CPU reload of tied embeddings: the output layer shares the
    embedding's weight, but on the CPU it computes through a GEMM handle prepacked from it at
    load time, and a reload of `embed_tokens` re-processes only the embedding. Measured on a
    Qwen2 model with tied embeddings: served logprobs were 0.75 off the new weights until the
    output layer was processed again."""
    from serving.reload import tied_output_layer

    tied = tied_output_layer(model)
    if tied is not None and any(n.endswith("embed_tokens.weight") for n in names):
        tied[0].quant_method.process_weights_after_loading(tied[0])


# vLLM fuses some checkpoint tensors into one layer (q/k/v weights and biases -> qkv_proj, every
# expert of a layer -> one RoutedExperts, gate/up of a dense MLP or of Qwen2-MoE's shared expert
# -> gate_up_proj). Its in-place reload rebuilds a layer only from what is sent: a layer given
# part of its tensors gets uninitialized memory for the rest (measured: reloading q_proj alone
# turned greedy logprobs into NaN). So a swap sends whole layers. (A tied output layer is the
# embedding itself: reloading the embedding reloads both.)
_FUSED = (
    (re.compile(r"^(.*\.self_attn)\.[qkv]_proj\.(weight|bias)$"), ".qkv_proj"),
    (re.compile(r"^(.*\.experts)\.\d+\.\w+\.weight$"), ""),
    (re.compile(r"^(.*)\.(gate|up)_proj\.weight$"), ".gate_up_proj"),
)


def vllm_layer(name: str) -> str:
    """The vLLM layer a checkpoint tensor loads into (the name itself when not fused)."""
    for pattern, suffix in _FUSED:
        if m := pattern.match(name):
            return m.group(1) + suffix
    return name


def reload_set(changed, names) -> list[str]:
    """The tensors to send so that every vLLM layer touched by `changed` gets all of its tensors."""
    layers = {vllm_layer(n) for n in changed}
    return sorted(n for n in names if vllm_layer(n) in layers)


# --- admission ---------------------------------------------------------------------------------


class _Flight:
    """One request in the engine: the id the engine knows it by, whether its client saw output,
    and whether its last output (every sample finished) came out."""

    __slots__ = ("engine_id", "stream", "seen", "finished", "restart")

    def __init__(self, engine_id: str, stream: bool):
        self.engine_id, self.stream = engine_id, stream
        self.seen = self.finished = self.restart = False

    @property
    def restartable(self) -> bool:
        """Nothing of it reached the client, and it is not done: a non-streamed request (only its
        last output is returned) or a stream before its first output, either still generating."""
        return not self.finished and not (self.stream and self.seen)


class GatedEngine:
    """An `Engine` whose admission can close while in-flight requests drain or restart (see the
    module docstring)."""

    def __init__(self, inner):
        self.inner = inner
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.inflight = 0
        self._flights: dict[str, _Flight] = {}  # by the caller's request id
        self.refusing: str | None = None  # why it serves nothing (set by HotSwapper), else None

    async def generate(self, prompt_ids, spec, request_id) -> AsyncIterator:
        for attempt in itertools.count():
            while not self._open.is_set():  # re-check: a new pause may start before this task runs
                await self._open.wait()
            if self.refusing is not None:
                raise OutOfService(self.refusing)
            # a restart gets an id of its own: vLLM may still hold the aborted one's state
            flight = _Flight(request_id if attempt == 0 else f"{request_id}~{attempt}", spec.stream)
            self._flights[request_id] = flight
            self.inflight += 1
            self._idle.clear()
            try:
                async for out in self.inner.generate(prompt_ids, spec, flight.engine_id):
                    if flight.restart:  # an output of the old weights after the abort: dropped
                        continue
                    flight.seen = True
                    flight.finished = bool(out) and all(s.finish_reason is not None for s in out)
                    yield out
            finally:
                self._flights.pop(request_id, None)
                self.inflight -= 1
                if self.inflight == 0:
                    self._idle.set()
            if not flight.restart:
                return

    async def abort(self, request_id: str) -> None:
        flight = self._flights.get(request_id)
        await self.inner.abort(flight.engine_id if flight is not None else request_id)

    @property
    def admitting(self) -> bool:
        return self._open.is_set()

    @contextlib.asynccontextmanager
    async def paused(self, drain_timeout_s: float, preempt_after_s: float | None = None):
        """Close admission and wait until nothing is in flight; reopen on exit, whatever happens.
        With `preempt_after_s`, the requests still in flight after that long whose client saw
        nothing are aborted and wait to run again once admission reopens. Yields a dict whose
        `restarted` says how many."""
        self._open.clear()
        info = {"restarted": 0}
        try:
            if preempt_after_s is not None and self.inflight:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), preempt_after_s)
                info["restarted"] = await self._restart_unseen()
            try:
                await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
            except TimeoutError:
                raise SwapError(
                    f"{self.inflight} in-flight request(s) did not finish within {drain_timeout_s:g} s"
                ) from None
            yield info
        finally:
            self._open.set()

    async def _restart_unseen(self) -> int:
        """Abort every in-flight request whose client saw nothing; each runs again after the pause."""
        chosen = [f for f in self._flights.values() if f.restartable and not f.restart]
        for f in chosen:
            f.restart = True
        for f in chosen:  # vLLM ends an aborted request's stream with a final "abort" output
            await self.inner.abort(f.engine_id)
        return len(chosen)

    def __getattr__(self, name):  # update_weights, shutdown, ...
        return getattr(self.inner, name)


# --- the replica side ---------------------------------------------------------------------------


@dataclass
class SwapReport:
    ok: bool
    version: int  # served after the call
    from_version: int
    target: int
    plan: dict = field(default_factory=dict)
    tensors_reloaded: int = 0
    reload_bytes: int = 0
    prepare_s: float = 0.0  # plan + fetch + verify + write + stage, while serving continues
    stage_s: float = 0.0  # of which the worker reading, checking and parsing the file (it holds the engine's steps), then preparing it (it does not)
    pause_s: float = 0.0  # admission closed: the wait for in-flight requests + the reload
    drain_s: float = 0.0  # the wait for in-flight requests: to finish, or to be aborted for a restart
    restarted: int = 0  # in-flight requests aborted to run again on the new version
    reload_s: float = 0.0
    prepared: bool = False  # the reload copied in weights prepared while serving (serving/reload.py)
    error: str | None = None


@dataclass
class _Served:
    version: int
    ckpt: dict
    hashes: dict[str, str]


@dataclass
class _Prepared:
    version: int
    plan: dict
    served: _Served
    changed: list[str]
    reloaded_all: bool = False  # every tensor is reloaded (the engine's weights were not known)
    show_policy: ShowPolicy | None = None  # the version's (learner/show.py); None: it has none
    folder: Path | None = None
    path: str = ""
    sha256: str = ""
    nbytes: int = 0


class HotSwapper:
    """Swaps a `CompletionService`'s weights to versions of a weight store, one swap at a time."""

    def __init__(
        self,
        service,
        store,
        *,
        drain_timeout_s: float = 60.0,
        preempt_after_s: float | None = 0.02,
        loaded_from: str | Path | None = None,
        pool: str = "",
    ):
        """`store`: a learner.store.Store, or its URI (opened on first use). `loaded_from`: the
        model folder the engine loaded; if its weights equal the store's copy of the version the
        replica started on, the first swap reloads only what changed (see `_recognize`). `pool`:
        the replica's pool, for the metrics ("" outside one). `preempt_after_s`: how long in-flight
        requests may finish before those whose client saw nothing are restarted on the new
        version (the module docstring); None waits for every one."""
        self.service = service
        self.pool = pool
        self.loaded_from = Path(loaded_from) if loaded_from is not None else None
        if not isinstance(service.engine, GatedEngine):
            service.engine = GatedEngine(service.engine)
        self._store = store
        self.drain_timeout_s = drain_timeout_s
        self.preempt_after_s = preempt_after_s
        self._served: _Served | None = None
        self._lock = asyncio.Lock()
        self.last_swap_error: str | None = None
        self.last_report: SwapReport | None = None
        self.swaps = 0
        self.failures = 0
        self._warm_tried = False

    @property
    def out_of_service(self) -> str | None:
        """Why the replica serves nothing (its weights are mixed), or None when it serves."""
        return self.gate.refusing

    @property
    def store(self):
        if isinstance(self._store, str):
            from learner.store import open_store

            self._store = open_store(self._store)
        return self._store

    @property
    def gate(self) -> GatedEngine:
        return self.service.engine

    def status(self) -> dict:
        return {
            "version": self.service.version,
            "store": self.store.uri() if not isinstance(self._store, str) else self._store,
            "weights_known": self._served is not None,
            "swaps": self.swaps,
            "failures": self.failures,
            "corrupt_objects": self.store.corrupt if not isinstance(self._store, str) else 0,
            "out_of_service": self.out_of_service,
            "last_swap_error": self.last_swap_error,
            "last_swap": asdict(self.last_report) if self.last_report else None,
        }

    def adopt(self, version: int) -> None:
        """Declare that the engine's weights are the store's `version` (e.g. the replica was
        started from that version's export), so the next swap reloads only changed tensors."""
        ckpt = self.store.materialize(version)
        self._served = _Served(version, ckpt, self.store.hashes(version))
        self.service.version = self.service.prompts.version = version
        self.service.show_policy = self.store.show_policy(version)

    async def swap_to(self, version: int) -> SwapReport:
        """Swap to `version`; raises SwapError (replica unchanged) on failure."""
        async with self._lock:
            frm = self.service.version
            report = SwapReport(ok=False, version=frm, from_version=frm, target=version)
            prepared = None
            corrupt = self.store.corrupt
            try:
                t0 = time.perf_counter()
                prepared = await asyncio.to_thread(self._prepare, version)
                report.plan, report.tensors_reloaded, report.reload_bytes = (
                    prepared.plan,
                    len(prepared.changed),
                    prepared.nbytes,
                )
                if prepared.changed:  # read and checked by the worker while serving goes on
                    t1 = time.perf_counter()
                    # Out of service, a reload broke off: the live tensors may be half restored
                    # (vLLM leaves placeholders without storage), no base to build on beside them.
                    await self.gate.inner.stage_weights(
                        prepared.path, prepared.sha256, prepare=self.out_of_service is None
                    )
                    report.stage_s = time.perf_counter() - t1
                report.prepare_s = time.perf_counter() - t0
                await self._switch(prepared, report)
            except Exception as e:
                report.error = f"swap v{frm} -> v{version} failed: {type(e).__name__}: {e}"
                self.failures += 1
                SWAPS.inc(pool=self.pool, outcome="failed")
                if self.store.corrupt > corrupt:
                    CORRUPT.inc(self.store.corrupt - corrupt, pool=self.pool)
                self.last_swap_error, self.last_report = report.error, report
                log.error("%s; still serving v%d", report.error, self.service.version)
                raise SwapError(report.error) from e
            finally:
                if prepared is not None and prepared.folder is not None:
                    shutil.rmtree(prepared.folder, ignore_errors=True)
            report.ok, report.version = True, version
            self.swaps += 1
            SWAPS.inc(pool=self.pool, outcome="ok")
            self.last_swap_error, self.last_report = None, report
            log.info(
                "swapped v%d -> v%d: %d tensors staged in %.3f s, pause %.3f s (drain %.3f s, %s %.3f s); "
                "%d request(s) restarted",
                frm,
                version,
                report.tensors_reloaded,
                report.stage_s,
                report.pause_s,
                report.drain_s,
                "prepared copy" if report.prepared else "reload",
                report.reload_s,
                report.restarted,
            )
            return report

    async def warm(self) -> float | None:
        """Reload the first layer's tensors from the model folder the engine loaded: the values it
        already holds, so nothing served changes. vLLM's first reload in a process pays one-time
        costs that later ones do not (measured on the demo model: the first swap's reload 150 ms
        under the demo's load against 70 ms for the next; idle, 78 against 59 ms), and this puts
        them before any swap's pause. Only before the first swap attempt, while the engine holds
        exactly the folder's weights; once only. Seconds taken, or None when it does nothing (no
        folder, a swap already tried, out of service). A failure is logged and handled as a
        swap's reload failure is."""
        if (
            self.loaded_from is None
            or self.out_of_service is not None
            or self._warm_tried
            or self.swaps
            or self.failures
        ):
            return None
        self._warm_tried = True
        from safetensors.torch import save

        async with self._lock:
            t0 = time.perf_counter()
            folder = None
            try:
                tensors = await asyncio.to_thread(self._first_layer)
                if not tensors:
                    return None
                folder, path, sha, nbytes = self._write(tensors, save)
                p = _Prepared(
                    self.service.version, {}, self._served, sorted(tensors), path=path, sha256=sha, nbytes=nbytes
                )
                await self.gate.inner.stage_weights(path, sha)
                async with self.gate.paused(self.drain_timeout_s, self.preempt_after_s):
                    await self._reload(p)
            except Exception as e:
                log.warning(
                    "warming the reload path failed (%s: %s); the first swap pays its costs", type(e).__name__, e
                )
                return None
            finally:
                if folder is not None:
                    shutil.rmtree(folder, ignore_errors=True)
            took = time.perf_counter() - t0
            log.info("reload path warmed: %d tensors of the first layer reloaded in %.3f s", len(tensors), took)
            return took

    def _first_layer(self) -> dict:
        """The model folder's tensors of its first layer, widened to whole vLLM layers."""
        return _folder_tensors(
            self.loaded_from, lambda names: reload_set([n for n in names if n.startswith("model.layers.0.")], names)
        )

    async def swap_report(self, version: int) -> dict:
        """swap_to, but failures come back as a report with ok=False (for callers over Ray)."""
        try:
            return asdict(await self.swap_to(version))
        except SwapError:
            return asdict(self.last_report)

    def _prepare(self, version: int) -> _Prepared:
        """Plan, fetch, verify, and write the changed tensors (runs in a thread)."""
        from safetensors.torch import save

        from learner.store import to_hf_tensors

        # Out of service, the engine's weights match no version: every tensor is reloaded.
        served = self._served if self._served is not None else (None if self.out_of_service else self._recognize())
        plan = self.store.plan(version, have=served.version if served is not None else None)
        base = served if served is not None and plan.have is not None else None
        ckpt, hashes = self.store.fetch(plan, base.ckpt if base else None, base.hashes if base else None)
        changed = reload_set([n for n in hashes if served is None or served.hashes.get(n) != hashes[n]], hashes)
        p = _Prepared(
            version,
            {"have": plan.have, "full": plan.full, "deltas": list(plan.deltas), "nbytes": plan.nbytes},
            _Served(version, ckpt, hashes),
            changed,
            reloaded_all=served is None,
            show_policy=self.store.show_policy(version),  # read first: an unreadable one fails the swap
        )
        if changed:
            p.folder, p.path, p.sha256, p.nbytes = self._write(to_hf_tensors(ckpt, changed), save)
        return p

    def _recognize(self) -> _Served | None:
        """The store's copy of the version this replica started on, if the folder it loaded holds
        exactly those weights (bit for bit, as vLLM loads them); else None (reload everything)."""
        if self.loaded_from is None or self.service.version not in self.store.versions():
            return None
        from safetensors.torch import load_file

        from learner.export import WEIGHTS_FILE
        from learner.store import to_hf_tensors

        try:
            loaded = load_file(str(self.loaded_from / WEIGHTS_FILE))
        except (OSError, ValueError) as e:
            log.info("cannot compare %s with the store (%s); the first swap reloads every tensor", self.loaded_from, e)
            return None
        ckpt = self.store.materialize(self.service.version)
        stored = to_hf_tensors(ckpt)
        if stored.keys() != loaded.keys() or any(not torch_equal(stored[k], loaded[k]) for k in stored):
            log.info(
                "%s differs from v%d in the store; the first swap reloads every tensor",
                self.loaded_from,
                self.service.version,
            )
            return None
        log.info(
            "%s holds exactly v%d of the store: swaps send only changed tensors from the start",
            self.loaded_from,
            self.service.version,
        )
        return _Served(self.service.version, ckpt, self.store.hashes(self.service.version))

    @staticmethod
    def _write(tensors: dict, save) -> tuple[Path, str, str, int]:
        folder = Path(tempfile.mkdtemp(prefix="flywheel-swap-"))
        data = save(tensors)
        path = folder / "update.safetensors"
        path.write_bytes(data)
        return folder, str(path), hashlib.sha256(data).hexdigest(), len(data)

    async def _switch(self, p: _Prepared, report: SwapReport) -> None:
        t0 = time.perf_counter()
        try:
            async with self.gate.paused(self.drain_timeout_s, self.preempt_after_s) as waited:
                t1 = time.perf_counter()
                report.drain_s, report.restarted = t1 - t0, waited["restarted"]
                if report.restarted:
                    RESTARTS.inc(report.restarted, pool=self.pool)
                if p.changed:
                    result = await self._reload(p)
                    report.prepared = isinstance(result, dict) and bool(result.get("prepared"))
                report.reload_s = time.perf_counter() - t1
                self.service.version = self.service.prompts.version = p.version
                self.service.show_policy = p.show_policy
                self._served = p.served
                if self.gate.refusing is not None and p.reloaded_all:
                    log.warning("every tensor reloaded to v%d: the replica serves again", p.version)
                    self.gate.refusing = None
        finally:
            report.pause_s = time.perf_counter() - t0
            SWAP_PAUSE.observe(report.pause_s, pool=self.pool)

    async def _reload(self, p: _Prepared):
        try:
            return await self.gate.inner.update_weights(p.path, p.sha256, p.version)
        except Exception as e:
            # The worker checks the file before loading, so most failures change nothing; if the
            # reload broke off midway, put the old tensors back so the replica really serves N.
            # Runs while admission is closed: nothing is served until this is settled.
            version = self.service.version
            why = await self._restore(p.changed)
            if why is not None:
                self._served = None  # unknown: the next swap reloads every tensor
                self.gate.refusing = (
                    f"a reload to v{p.version} broke off ({type(e).__name__}: {e}) and v{version}'s tensors "
                    f"could not be put back ({why}): the weights are mixed"
                )
                log.error("out of service: %s", self.gate.refusing)
            raise

    async def _restore(self, names: list[str]) -> str | None:
        """Reload the served version's `names` (None), or say why that cannot be done."""
        from safetensors.torch import save

        try:
            tensors = await asyncio.to_thread(self._served_tensors, names)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        folder, path, sha, _ = self._write(tensors, save)
        try:
            await self.gate.inner.update_weights(path, sha, self.service.version)
            return None
        except Exception as e:
            return f"reloading them failed too: {type(e).__name__}: {e}"
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _served_tensors(self, names: list[str]) -> dict:
        """The bf16 tensors `names` of the weights the replica served before this swap: from the
        checkpoint it keeps, else (no swap yet) from the model folder the engine loaded."""
        from learner.store import to_hf_tensors

        if self._served is not None:
            return to_hf_tensors(self._served.ckpt, names)
        if self.loaded_from is None:
            raise ValueError("the replica keeps no copy of them and knows no model folder")

        def present(have: list[str]) -> list[str]:
            missing = sorted(set(names) - set(have))
            if missing:
                raise ValueError(f"{self.loaded_from} lacks {len(missing)} of them, e.g. {missing[0]}")
            return names

        return _folder_tensors(self.loaded_from, present)


def _folder_tensors(folder: Path, pick) -> dict:
    """The tensors `pick(names in the file)` of a model folder's weights file, read one by one."""
    from safetensors import safe_open

    from learner.export import WEIGHTS_FILE

    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
        return {n: f.get_tensor(n) for n in pick(list(f.keys()))}
