"""`flywheel serve` configuration: the `[serve]` section on top of the shared settings."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import AfterValidator, Field, SecretStr, model_validator

from feedback.core.auth import DashboardLogin
from feedback.core.config import FlywheelSettings, Section
from feedback.core.files import open_private, private_dir
from feedback.core.web import HttpLimits
from learner.base_settings import ModelSection
from learner.prompts import CONTEXT_BUDGET, CONTEXT_TOKENS, SUMMARY_CHUNK_TOKENS, fit_budget


def _queue_limit(n: int) -> int:
    if n < 1 and n != -1:
        raise ValueError("must be -1 (no limit) or at least 1")
    return n


class EngineSettings(Section):
    """vLLM engine arguments for each model replica."""

    max_model_len: int = Field(default=2048, ge=64)
    """Context window the engine allocates KV cache for (prompt + completion tokens); capped at
    the model's own window."""
    dtype: str = Field(default="auto", pattern="^(auto|bfloat16|float16|float32)$")
    """vLLM's compute dtype. `auto`: bfloat16 where the CPU or GPU runs it fast, float32 elsewhere
    (measured at start, see feedback/core/precision.py: an AVX2-only CPU runs bf16 ~75x slower). On
    a local Ray, `flywheel serve` measures once for all its replicas; replicas joining a cluster
    measure on their own hosts."""
    enforce_eager: bool = True
    """Skip CUDA-graph / torch.compile capture (start-up time matters more than peak speed here)."""
    kv_cache_gib: float = Field(default=1.0, gt=0)
    """CPU KV cache size (`VLLM_CPU_KVCACHE_SPACE`); ignored on GPUs."""
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    max_num_seqs: int = Field(default=64, ge=1)
    """Most sequences one engine step batches together."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (an editor resends most of a file)."""
    num_gpus: float = Field(default=0, ge=0)
    """GPUs per model worker (Ray resource); 0 on CPU machines. A replica has `world_size` workers."""
    num_cpus: float = Field(default=1, ge=0)
    """CPUs per replica (Ray resource)."""
    cpu_binding: str = Field(default="auto", pattern=r"^(auto|nobind|[0-9,|-]+)$")
    """Where a CPU replica's model threads run (vLLM's `VLLM_CPU_OMP_THREADS_BIND`, unless that is
    set). `auto`: vLLM pins them to one NUMA node's cores less one it leaves to everything else,
    as if the engine had the node to itself; every replica on a node pins the same cores.
    `nobind`: not pinned, so the kernel spreads the replicas and other work over the cores (as
    many threads as the replica's CPUs, `num_cpus`). Or explicit core lists, `0-3` (one worker)
    or `0-3|4-7` (one list per worker)."""
    log_stats: bool = True
    """vLLM's engine statistics: time to first token, queue, prefill and decode time, KV-cache use,
    running and waiting requests (exported through Ray's metrics, see `serve.ray_metrics_port`), and
    each completion's time to first token in the ingress's metrics. False: none of them."""
    executor: str = Field(default="uni", pattern="^(uni|mp|ray)$")
    """vLLM's worker executor (`distributed_executor_backend`). `uni`: the model worker runs inside
    the engine-core process, one process fewer to start per replica (vLLM start-up is mostly
    imports: measured 16.5 s against 25.4 s on 2 cores, 51 against 65 s with the cores loaded);
    `mp` or `ray` for tensor parallelism across GPUs. On CPUs vLLM 0.32 runs the worker in a
    process of its own whatever this says (its OpenMP set-up needs one), as `mp`."""
    capture_routes: bool = True
    """Record the experts vLLM's forward chose for every token of an MoE model (serving/routes.py),
    so the learner replays the serving engine's own routing. False: the learner routes itself."""
    prepared_reload: bool = True
    """Swaps build the new weights in the kernels' layout beside the live model while it serves,
    and the pause only copies them in (serving/reload.py); it holds a second copy of the touched
    layers until then. False: vLLM's own in-place reload, all of it inside the pause, and no second
    copy (also the fallback for a layer kind the prepared reload does not handle)."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """vLLM tensor parallelism: every layer's matrices split over this many workers (one GPU each)."""
    pipeline_parallel_size: int = Field(default=1, ge=1)
    """vLLM pipeline parallelism: the layers split into this many stages, one worker each. Stages may
    sit on different nodes (with `executor = "ray"`)."""
    data_parallel_size: int = Field(default=1, ge=1)
    """vLLM's data parallelism inside one replica: this many copies of the attention layers, which with
    `enable_expert_parallel` share the MoE experts between them (wide expert parallelism). Plain data
    parallelism is more replicas (`serve.replicas`), which needs nothing here."""
    enable_expert_parallel: bool = False
    """Place whole MoE experts on the tensor × data parallel workers instead of splitting every expert
    over them (vLLM's expert parallelism)."""
    quantization: str | None = Field(default=None, pattern="^[a-z0-9_-]+$")
    """vLLM's quantization method for the served weights (for example `fp8`: weights quantized as they
    load; an in-place swap reloads checkpoint-format tensors and vLLM quantizes them again, layer by
    layer). None: the exported dtype. The learner's FP4 training and the deltas do not depend on it."""
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    """How a replica's workers are placed with `executor = "ray"` (Ray placement group strategy).
    STRICT_PACK: all on one node (tensor parallelism wants NVLink); PACK: spill to other nodes only
    when one node lacks GPUs (pipeline stages across nodes)."""

    @property
    def world_size(self) -> int:
        """Model workers of one replica: tensor × pipeline × data parallel sizes."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @model_validator(mode="after")
    def _parallelism_fits_the_executor(self) -> Self:
        if self.world_size > 1 and self.executor == "uni":
            raise ValueError(
                f"serve.engine: {self.world_size} model workers (tensor × pipeline × data parallel) need "
                'executor = "mp" (one node) or "ray" (placement group, may span nodes), not "uni"'
            )
        if self.world_size > 1 and self.executor == "ray" and self.num_gpus == 0:
            raise ValueError(
                'serve.engine: executor = "ray" places one GPU per model worker; on CPUs use executor = "mp" '
                "for tensor parallelism"
            )
        if self.world_size > 1 and self.executor == "ray" and self.num_gpus != 1:
            raise ValueError(
                'serve.engine: with executor = "ray" each model worker takes exactly one GPU (num_gpus = 1), '
                f"got num_gpus = {self.num_gpus:g}"
            )
        if self.enable_expert_parallel and self.tensor_parallel_size * self.data_parallel_size == 1:
            raise ValueError(
                "serve.engine.enable_expert_parallel spreads experts over the tensor × data parallel workers: "
                "set tensor_parallel_size or data_parallel_size above 1"
            )
        return self


class ServeSettings(Section):
    host: str = "127.0.0.1"
    """Address the HTTP API listens on."""
    port: int = Field(default=8000, ge=1, le=65535)
    ray_address: str = ""
    """Ray cluster to join (`ray://head:10001` or `auto`). Empty: start a local Ray."""
    ray_num_cpus: int | None = Field(default=None, ge=1)
    """CPUs a local Ray may use (None: all)."""
    ray_metrics_port: int | None = Field(default=None, ge=1, le=65535)
    """Port of a local Ray's metrics agent, which exports the replicas' metrics (hot swaps, vLLM's
    engine statistics) for Prometheus at `http://<node>:<port>/metrics`. None: a free port Ray
    picks, printed at start and listed in Ray's `prom_metrics_service_discovery.json` (in its
    session folder, /tmp/ray by default). A cluster that Flywheel joins uses its own
    (`ray start --metrics-export-port`)."""
    max_replicas_per_node: int | None = Field(default=None, ge=1, le=100)
    """Most replicas of one pool (stable or canary, each counted on its own) that Ray Serve places
    on one node; 1 spreads a pool's replicas over as many nodes. None: no limit, Ray Serve packs
    them where resources allow. Not with replica placement groups (`engine.executor = "ray"` and
    more than one model worker), which Ray Serve places by `engine.placement_strategy` instead."""
    replica_dir: Path | None = None
    """Where each model replica keeps its node's own files: the exported version it loads
    (`served/v<N>`) and the payloads it fetched from an object-store weight store (`store/`).
    A replica resolves it on the node it runs on: FLYWHEEL_SERVE__REPLICA_DIR in that node's
    environment (the one `ray start` ran in) wins over this value. None: `<data_dir>/served`
    and `store.cache_dir`, the same paths on every node (each node's own disk). Set it per node
    where several Ray nodes share one disk."""
    model_dir: Path | None = None
    """Exported Hugging Face folder of the model to serve. Empty: the cached pretrained base."""
    model_version: int = Field(default=0, ge=0)
    """Version number of `model_dir` (the weight store supplies it once the learner publishes)."""
    model_name: str = "flywheel"
    """The `model` name clients send and `/v1/models` lists."""
    replicas: int = Field(default=1, ge=1)
    """Model replicas of the stable pool (every user not routed to the canary)."""
    canary_replicas: int = Field(default=1, ge=0)
    """Model replicas of the canary pool, which serves the users a rollout assigns to it. 0: no canary
    pool (then `flywheel swap` moves everyone at once, and rollouts have nowhere to send users)."""
    max_ongoing_requests: int | None = Field(default=None, ge=1)
    """Requests Ray Serve lets one model replica hold at once (its `max_ongoing_requests`); the
    engine batches them. None: `engine.max_num_seqs`, what one engine step can batch (Ray Serve's
    own default, 5, would queue the rest in front of an engine with room for more)."""
    access_log: bool = False
    """Ray Serve's access log: a line per request from the HTTP proxy and from each replica a
    request passes. Off by default: every completion already has its record (Kafka, table
    `completions`) and its latency and errors in the metrics, and the lines are written on the
    request path."""
    max_queued_requests: Annotated[int, AfterValidator(_queue_limit)] = 64
    """Requests the ingress lets wait for a model replica with room, per pool; beyond it a
    completion gets 503 with Retry-After at once instead of queueing (Ray Serve's
    `max_queued_requests`). -1: no limit."""
    pool_poll_s: float = Field(default=1.0, gt=0)
    """How often replicas and the ingress read the target versions (table `serving_pools`): a
    replica swaps in place to its pool's new target within about this long."""
    swap_preempt_after_ms: int = Field(default=20, ge=-1)
    """How long a hot swap lets in-flight requests finish on the old weights before it aborts
    those whose client has seen nothing yet (every non-streamed completion, a stream before its
    first token) and runs them again, whole, on the new version once it is loaded
    (`flywheel_swap_restarts_total`). Admission is closed meanwhile, so the swap's pause is about
    this plus the reload, instead of the slowest request in flight (seconds on a busy CPU); a
    restarted request pays what it had run. Streams that have sent tokens always finish on the
    old version. -1: wait for every request to finish."""
    engine: EngineSettings = EngineSettings()

    auth_tokens: list[SecretStr] = []
    """Bearer tokens editor clients may send. Prefer `auth_tokens_file` or FLYWHEEL_SERVE__AUTH_TOKENS."""
    auth_tokens_file: Path | None = None
    """A file with one editor token per line (blank lines and `#` comments ignored), or `token, user`
    to name the user a token belongs to: a named user's `user_hash` is the HMAC of the name, the same
    whichever of their tokens they send, so their canary bucket and rate limits follow them (and
    the `user` field of a request does not change it). A token names at most one user."""
    allow_anonymous: bool = False
    """Serve without tokens (local development only; refused unless set explicitly)."""
    ops_tokens: list[SecretStr] = []
    """Bearer tokens for ops actions (rollouts, swaps, the dashboard). Editor tokens never qualify.
    Prefer `ops_tokens_file` or FLYWHEEL_SERVE__OPS_TOKENS. Empty: the ops endpoints refuse everyone."""
    ops_tokens_file: Path | None = None
    """A file with one ops token per line."""
    user_hash_secret: SecretStr = SecretStr("")
    """Key of the HMAC that turns an editor token and `user` id into `user_hash` (serving/routing.py).
    Empty: a random key kept in <data_dir>/user_hash.key, created owner-only by the first `flywheel
    serve`, so hashes survive restarts. Set it (FLYWHEEL_SERVE__USER_HASH_SECRET) where several
    deployments must agree on hashes; changing it gives every user a new hash and canary bucket."""

    max_prompt_chars: int = Field(default=200_000, ge=1)
    """Longest prefix + suffix accepted, in characters; longer requests get 413."""
    max_tokens_limit: int = Field(default=256, ge=1)
    """Upper bound for a request's `max_tokens`."""
    max_n: int = Field(default=4, ge=1, le=16)
    """Upper bound for a request's `n`."""
    default_max_tokens: int = Field(default=64, ge=1)
    """`max_tokens` when a request does not send one."""
    max_stop_strings: int = Field(default=32, ge=1, le=1024)
    """Most stop strings one request may send (OpenAI's `stop`, Ollama's `options.stop`); more get
    422. Editor clients send their template's tokens, blank lines and language keywords: a dozen or two."""

    context_budget: int = Field(default=CONTEXT_BUDGET, ge=32)
    """Prompt tokens a completion may use; longer prefixes are self-summarized into it."""
    summary_chunk_tokens: int = Field(default=SUMMARY_CHUNK_TOKENS, ge=16)
    """Size of the prefix chunks that are replaced by summaries."""
    summary_max_tokens: int = Field(default=48, ge=4)
    """Longest summary the model may write for one chunk."""
    summary_cache_size: int = Field(default=4096, ge=0)
    """Summaries cached per replica (by chunk hash, with the version that wrote each)."""
    max_routing_chars: int = Field(default=512 * 1024, ge=0, le=4_000_000)
    """Longest routing trace (the experts vLLM chose per token, feedback.routing's text) a completion
    record carries; a longer one is left out and counted (`flywheel_routing_traces_total`), so the
    record stays within Kafka's message size (1 MB by default). About 0.5 KB a token for a 48-layer,
    top-8 MoE when routes compress badly, about 6 bytes for Flywheel's `small`."""
    summary_reuse_versions: int = Field(default=2, ge=0)
    """A cached summary serves the version that wrote it and this many later ones, so a replica's
    cache stays warm across a hot swap (learner.prompts.SummaryCache). 0: each version writes its own."""
    repo_context_tokens: int = Field(default=CONTEXT_TOKENS, ge=0)
    """Prompt tokens other files of the repository (Tabby's declarations and snippets, llama.cpp's
    `input_extra`, files in a client-rendered prompt) keep when the current file would fill
    `context_budget` (at most half of it); a short file leaves them the rest. 0: only what the
    file leaves."""
    max_summaries_per_request: int = Field(default=0, ge=0)
    """Most summaries one request may have the model write (cached ones are free): chunks are
    summarized newest first until the summaries fill their room or this many were written; older
    chunks are left out and counted (`flywheel_summaries_total{source="skipped"}`). 0 (the
    default): truncate. Self-summaries are off by default because on the default `small` model
    they do not beat truncation at the same budget (`flywheel bench longctx --beyond-window`:
    edit similarity 0.258 against 0.262 on 58 cursors whose answer was defined 2-8k tokens back,
    p = 0.67); 4 turns them on. A model without Flywheel's summary tokens is prompted with
    plain-text markers."""
    summarize_in_background: bool = True
    """Write missing summaries off the request's path: a completion whose summaries are not all
    cached is answered with its prefix truncated, and the replica writes them in the background,
    one at a time, newest first, for the file's next request (an editor asks again at every
    pause). Counted as `flywheel_summaries_total{source="deferred"}`. False: the request waits
    while up to `max_summaries_per_request` are written (in `make demo` on 2 cores that was a
    mean of 2.2 s per request, 10 s for the slowest 5%)."""
    summary_queue: int = Field(default=64, ge=1)
    """Summaries waiting to be written in the background, per replica; beyond it the oldest are
    dropped (their files were edited longest ago)."""

    producer_buffer: int = Field(default=10_000, ge=1)
    """Records held in memory while Kafka is unreachable; beyond that they are dropped and counted."""
    limits: HttpLimits = HttpLimits()
    """What one client may send and how often (section `[serve.limits]`)."""
    dashboard: DashboardLogin = DashboardLogin()
    """The ops dashboard's login session (section `[serve.dashboard]`)."""

    @model_validator(mode="after")
    def _spread_without_placement_groups(self) -> Self:
        eng = self.engine
        if self.max_replicas_per_node is not None and eng.executor == "ray" and eng.world_size > 1:
            raise ValueError(
                "serve.max_replicas_per_node cannot be combined with replica placement groups "
                f'(engine.executor = "ray" with {eng.world_size} model workers): Ray Serve refuses both; '
                "unset it (each replica's placement group takes whole GPUs already)"
            )
        return self

    @model_validator(mode="after")
    def _budget_fits(self) -> Self:
        if self.context_budget + 8 > self.engine.max_model_len:
            raise ValueError(
                f"serve.context_budget ({self.context_budget}) must leave room in engine.max_model_len ({self.engine.max_model_len})"
            )
        return self

    def fitted_to(self, model_max_len: int) -> ServeSettings:
        """These settings within a model's context window (its max_position_embeddings): the
        engine allocates no more than the model can attend to, and a quarter of the window is
        kept for the completion."""
        max_len = min(self.engine.max_model_len, model_max_len)
        budget, chunk = fit_budget(max_len, self.context_budget, self.summary_chunk_tokens)
        return self.model_copy(
            update={
                "engine": self.engine.model_copy(update={"max_model_len": max_len}),
                "context_budget": budget,
                "summary_chunk_tokens": chunk,
            }
        )

    def user_hash_key(self) -> bytes:
        """The HMAC key of `user_hash`: the secret, else one random key per process (an app built
        in-process, by a test or a benchmark; `serving.app.start` fills the secret in first)."""
        secret = self.user_hash_secret.get_secret_value()
        return secret.encode() if secret else _PROCESS_KEY

    def editor_tokens(self) -> set[str]:
        return _tokens(self.auth_tokens, self.auth_tokens_file, "serve.auth_tokens_file")

    def editor_token_users(self) -> dict[str, str]:
        """The user each named editor token belongs to (`token, user` lines of auth_tokens_file)."""
        if self.auth_tokens_file is None:
            return {}
        lines = _token_lines(self.auth_tokens_file, "serve.auth_tokens_file", named=True)
        return {token: user for token, user in lines if user is not None}

    def ops_token_set(self) -> set[str]:
        return _tokens(self.ops_tokens, self.ops_tokens_file, "serve.ops_tokens_file")


def _tokens(inline: list[SecretStr], file: Path | None, what: str) -> set[str]:
    tokens = {t.get_secret_value() for t in inline if t.get_secret_value()}
    if file is not None:
        tokens |= {token for token, _ in _token_lines(file, what, named=what == "serve.auth_tokens_file")}
    return tokens


def _token_lines(file: Path, what: str, *, named: bool) -> list[tuple[str, str | None]]:
    """(token, user or None) per line of a tokens file; blank lines and `#` comments skipped. A
    malformed line is a ValueError naming its number, never its content (it holds a token)."""
    try:
        lines = file.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {what} {file}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {file} is not UTF-8 text") from None
    out: list[tuple[str, str | None]] = []
    owner: dict[str, str | None] = {}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if "," not in text:
            token, user = text, None
        else:
            fields = [f.strip() for f in text.split(",")]
            expected = "`token, user`" if named else "one token, no commas"
            if not named or len(fields) != 2 or not fields[0] or not fields[1]:
                raise ValueError(f"{what} {file}: line {number} is malformed: expected `token` or {expected}")
            token, user = fields
        if any(ch.isspace() for ch in token):
            raise ValueError(f"{what} {file}: line {number} is malformed: a token holds no spaces")
        if token in owner and owner[token] != user:
            raise ValueError(f"{what} {file}: line {number} gives a token listed before another user")
        owner[token] = user
        out.append((token, user))
    return out


_PROCESS_KEY = secrets.token_bytes(32)
USER_HASH_KEY_FILE = "user_hash.key"


class ServingSettings(FlywheelSettings):
    """`flywheel serve`: the Ray Serve application."""

    serve: ServeSettings = ServeSettings()
    model: ModelSection = ModelSection()

    def with_user_hash_secret(self) -> ServingSettings:
        """These settings with `serve.user_hash_secret` filled in: as set, else the key in
        <data_dir>/user_hash.key, created (random, owner-only) if there is none yet. What the
        ingress replicas get, so that all of them, and every restart, hash a user alike."""
        if self.serve.user_hash_secret.get_secret_value():
            return self
        path = private_dir(self.data_dir) / USER_HASH_KEY_FILE
        if not path.exists():
            # Written whole under a temporary name, then linked into place: a concurrent start
            # finds either no key or the complete one (link refuses to replace it).
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
            with open_private(tmp) as f:
                f.write(secrets.token_hex(32).encode())
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        key = path.read_text().strip()
        if not key:
            raise ValueError(f"{path} is empty: delete it and start again (a new key gives users new hashes)")
        return self.model_copy(update={"serve": self.serve.model_copy(update={"user_hash_secret": SecretStr(key)})})
