"""The HTTP API: `/v1/completions` (OpenAI and Tabby shapes), `/v1/events`, health, metrics.

`build_app()` makes the FastAPI app; its routes read an `ApiState`, which the Ray Serve
ingress installs with handles to the replica pools (stable, canary) and unit tests set with
local services. Every served completion is recorded to `flywheel.completions`, tagged with the
version that produced it, and every event to `flywheel.events`, through a buffered producer
that never holds up a request.

Routing: `poll_routing` reads the target state (feedback/pools.py) every `serve.pool_poll_s`
and asks each pool which version it serves. A user goes to the canary (sticky by user hash,
serving/routing.py) only while a canary is set with a share above 0 AND the canary pool
already reports that version; otherwise, and while it swaps, to stable.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import platform
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import Discriminator, Tag
from starlette.exceptions import HTTPException as StarletteHTTPException

from feedback import bus
from feedback.core.errors import first_line
from feedback.pools import CANARY, POOLS, STABLE, Routes
from feedback.schemas import CompletionChoice, CompletionRecord, FeedbackEvent
from learner.fim import fim_header
from learner.prompts import EDITOR_STOP
from serving import metrics
from serving.engine import SamplingSpec
from serving.replica import GenerateRequest, GenerateResult
from serving.routing import bucket, user_hash
from serving.schemas import (
    Choice,
    CompletionResponse,
    EventAccepted,
    EventRequest,
    LogProbs,
    OpenAICompletionRequest,
    TabbyCompletionRequest,
    Usage,
)
from serving.settings import ServeSettings

log = logging.getLogger(__name__)


class ReplicaClient(Protocol):
    """One replica pool, as the ingress sees it (serving.app.RayReplica over a deployment handle)."""

    async def complete(self, req: GenerateRequest) -> GenerateResult: ...

    def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]: ...

    async def served_version(self) -> int: ...


class RecordSink(Protocol):
    def send(self, topic: str, msg: Any) -> bool: ...


@dataclass
class RoutingState:
    """What the ingress knows of the pools: the targets in SQL and the version each pool
    reported at the last poll (None: not known, or the pool did not answer).

    A pool of several replicas answers `version` from one of them, so while a pool swaps it
    may report the new version before a sibling has it; a user routed there then may get the
    old version for a moment. That is harmless: each completion is tagged with the version
    that really produced it (GenerateResult.model_version), and so is its record."""

    routes: Routes = field(default_factory=Routes)
    serving: dict[str, int | None] = field(default_factory=dict)
    checked_at: float | None = None  # wall time of the last poll
    error: str | None = None  # the last poll's database error; the routes read before it stay

    @property
    def canary_live(self) -> bool:
        """Whether users go to the canary: it has a version and a share, and already serves it."""
        r = self.routes
        return r.canary is not None and r.canary_percent > 0 and self.serving.get(CANARY) == r.canary

    def pick(self, uhash: str) -> str:
        """The pool for this user: the canary for the users whose bucket is below its share, once live."""
        return CANARY if self.canary_live and bucket(uhash) < self.routes.canary_percent else STABLE

    def pool_serving(self, version: int) -> str | None:
        """A pool that serves `version` now (stable first)."""
        return next((p for p in POOLS if self.serving.get(p) == version), None)

    @property
    def versions(self) -> list[int]:
        return sorted({v for v in self.serving.values() if v is not None})


@dataclass
class ApiState:
    cfg: ServeSettings
    replicas: dict[str, ReplicaClient]  # by pool name: feedback.pools.STABLE, CANARY (absent: not deployed)
    producer: RecordSink
    editor_tokens: set[str]
    decode: Any  # token ids -> text (the served model's tokenizer)
    routing: RoutingState = field(default_factory=RoutingState)
    started: float = field(default_factory=time.time)
    ops_tokens: set[str] = field(default_factory=set)
    database_url: str | None = None


async def refresh_routing(st: ApiState, read_routes: Callable[[], Routes], *, timeout_s: float = 10.0) -> None:
    """One poll: the targets (`read_routes`, blocking, so in a thread), then each pool's version."""
    rt = st.routing
    try:
        rt.routes = await asyncio.to_thread(read_routes)
        if rt.error is not None:
            log.info("serving targets readable again")
        rt.error = None
    except Exception as e:  # keep routing as it stood: a database blip must not move users
        msg = f"reading the serving targets (serving_pools) failed: {first_line(e)}"
        if msg != rt.error:
            log.error("%s (is the database migrated? `flywheel db upgrade`); routing as before", msg)
        rt.error = msg

    async def ask(pool: str, client: ReplicaClient) -> None:
        try:
            rt.serving[pool] = await asyncio.wait_for(client.served_version(), timeout_s)
        except Exception as e:  # a pool that does not answer gets no canary users and no pinned ones
            if rt.serving.get(pool) is not None:
                log.warning("the %s pool did not report its version: %s: %s", pool, type(e).__name__, e)
            rt.serving[pool] = None

    await asyncio.gather(*(ask(p, c) for p, c in st.replicas.items()))
    rt.checked_at = time.time()


async def poll_routing(st: ApiState, read_routes: Callable[[], Routes], interval_s: float) -> None:
    """`refresh_routing` every `interval_s`, forever (the ingress runs it as a background task)."""
    while True:
        try:
            await refresh_routing(st, read_routes)
        except Exception:
            log.exception("refreshing the routing state failed")
        await asyncio.sleep(interval_s)


# The Ray Serve ingress builds its own app in its replica process (`serve.ingress(build_app)`)
# and installs the state here; tests set `app.state.api` on the app they build.
_installed: ApiState | None = None


def install(state: ApiState) -> None:
    global _installed
    _installed = state


def _state(request: Request) -> ApiState:
    st = getattr(request.app.state, "api", None) or _installed
    if st is None:
        raise HTTPException(503, "the API is starting up")
    return st


# --- auth ------------------------------------------------------------------------------------


def require_editor(request: Request) -> str:
    """The caller's bearer token, if it is an editor token; 401 otherwise."""
    st = _state(request)
    if not st.editor_tokens and st.cfg.allow_anonymous:
        return "anonymous"
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(
            401, "missing bearer token: send `Authorization: Bearer <token>`", headers={"WWW-Authenticate": "Bearer"}
        )
    if not any(hmac.compare_digest(token.encode(), t.encode()) for t in st.editor_tokens):
        raise HTTPException(401, "invalid token", headers={"WWW-Authenticate": "Bearer"})
    return token


def require_ops(request: Request) -> str:
    """The caller's bearer token, if it is an ops token: 401 without a valid token, 403 for an
    editor token (it authenticates, but may not act on rollouts) or when no ops token is set."""
    st = _state(request)
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(
            401, "missing ops token: send `Authorization: Bearer <ops token>`", headers={"WWW-Authenticate": "Bearer"}
        )
    if any(hmac.compare_digest(token.encode(), t.encode()) for t in st.ops_tokens):
        return token
    if any(hmac.compare_digest(token.encode(), t.encode()) for t in st.editor_tokens):
        raise HTTPException(403, "an editor token cannot perform ops actions; use an ops token (serve.ops_tokens)")
    if not st.ops_tokens:
        raise HTTPException(403, "ops endpoints are disabled: no ops token is configured (serve.ops_tokens)")
    raise HTTPException(401, "invalid ops token", headers={"WWW-Authenticate": "Bearer"})


EditorToken = Annotated[str, Depends(require_editor)]
OpsToken = Annotated[str, Depends(require_ops)]
StateDep = Annotated[ApiState, Depends(_state)]


def _shape(body: Any) -> str:
    return (
        "tabby"
        if isinstance(body, dict) and ("segments" in body or ("language" in body and "prompt" not in body))
        else "openai"
    )


CompletionBody = Annotated[
    Annotated[OpenAICompletionRequest, Tag("openai")] | Annotated[TabbyCompletionRequest, Tag("tabby")],
    Discriminator(_shape),
]


# --- request translation -----------------------------------------------------------------------


def _to_generate(
    st: ApiState, body: OpenAICompletionRequest | TabbyCompletionRequest, completion_id: str
) -> GenerateRequest:
    cfg = st.cfg
    if isinstance(body, TabbyCompletionRequest):
        seg = body.segments
        prefix, suffix = seg.prefix, seg.suffix or ""
        header = fim_header(language=body.language, path=seg.filepath)
        temperature = body.temperature if body.temperature is not None else 0.2
        spec = SamplingSpec(
            n=1, max_tokens=cfg.default_max_tokens, temperature=temperature, seed=body.seed, stop=(EDITOR_STOP,)
        )
    else:
        prefix, suffix, header = body.prompt_text, body.suffix, ""
        if body.n > cfg.max_n:
            raise HTTPException(400, f"n={body.n} exceeds the limit of {cfg.max_n}")
        max_tokens = body.max_tokens or cfg.default_max_tokens
        if max_tokens > cfg.max_tokens_limit:
            raise HTTPException(400, f"max_tokens={max_tokens} exceeds the limit of {cfg.max_tokens_limit}")
        spec = SamplingSpec(
            n=body.n,
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=tuple(body.stop_list),
            top_logprobs=body.logprobs or 0,
        )
    if len(prefix) + len(suffix or "") > cfg.max_prompt_chars:
        raise HTTPException(
            413, f"prompt of {len(prefix) + len(suffix or '')} characters exceeds the limit of {cfg.max_prompt_chars}"
        )
    return GenerateRequest(completion_id=completion_id, prefix=prefix, suffix=suffix, header=header, spec=spec)


def _pick(st: ApiState, body, uhash: str) -> ReplicaClient:
    """The pool for this request: the one serving a pinned `model: name@vN`, else the user's route."""
    model = getattr(body, "model", None) or ""
    if "@v" in model:
        try:
            pinned = int(model.rsplit("@v", 1)[1])
        except ValueError:
            raise HTTPException(400, f"bad model {model!r}: expected {st.cfg.model_name}@v<version>") from None
        pool = st.routing.pool_serving(pinned)
        if pool is None or pool not in st.replicas:
            raise HTTPException(404, f"model version {pinned} is not served (serving: {st.routing.versions})")
    else:
        pool = st.routing.pick(uhash)
    if pool not in st.replicas:
        raise HTTPException(503, f"no {pool} replica pool is deployed")
    return st.replicas[pool]


def _response(st: ApiState, r: GenerateResult, body, created: int) -> CompletionResponse:
    want_lp = isinstance(body, OpenAICompletionRequest) and body.logprobs is not None
    choices = []
    for s in r.samples:
        lp = None
        if want_lp:
            pieces = [st.decode([t]) for t in s.token_ids]
            offsets, pos = [], 0
            for p in pieces:
                offsets.append(pos)
                pos += len(p)
            top = [{st.decode([t]): v for t, v in alt.items()} for alt in s.top_logprobs] if body.logprobs else None
            lp = LogProbs(tokens=pieces, token_logprobs=s.logprobs, top_logprobs=top, text_offset=offsets)
        finish = s.finish_reason if s.finish_reason in ("stop", "length") else None
        choices.append(Choice(index=s.index, text=s.text, logprobs=lp, finish_reason=finish))
    completion_tokens = sum(len(s.token_ids) for s in r.samples)
    return CompletionResponse(
        id=r.completion_id,
        created=created,
        model=f"{st.cfg.model_name}@v{r.model_version}",
        choices=choices,
        usage=Usage(
            prompt_tokens=len(r.prompt_token_ids),
            completion_tokens=completion_tokens,
            total_tokens=len(r.prompt_token_ids) + completion_tokens,
        ),
        system_fingerprint=f"v{r.model_version}",
    )


def _record(st: ApiState, r: GenerateResult, uhash: str, body, shape: str) -> None:
    """Count the completion and hand its record to the producer (never blocks, never raises)."""
    language = filepath = None
    if isinstance(body, TabbyCompletionRequest):
        language, filepath = body.language, body.segments.filepath
    record = CompletionRecord(
        completion_id=r.completion_id,
        model_version=r.model_version,
        user_hash=uhash,
        language=language,
        filepath=filepath,
        prompt_token_ids=r.prompt_token_ids,
        choices=[
            CompletionChoice(
                index=s.index,
                token_ids=s.token_ids,
                logprobs=[min(lp, 0.0) for lp in s.logprobs],
                text=s.text,
                finish_reason=s.finish_reason if s.finish_reason in ("stop", "length", "abort") else None,
            )
            for s in r.samples
        ],
        summary_ids=r.summary_ids,
        latency_ms=r.latency_ms,
        prompt_text=st.decode(r.prompt_token_ids, skip_special_tokens=False),
    )
    st.producer.send(bus.COMPLETIONS, record)
    v = str(r.model_version)
    metrics.COMPLETIONS.labels(v, shape).inc()
    metrics.TOKENS.labels("prompt").inc(len(r.prompt_token_ids))
    metrics.TOKENS.labels("completion").inc(sum(len(s.token_ids) for s in r.samples))
    if all(not s.text for s in r.samples):
        metrics.EMPTY.labels(v).inc()
    metrics.SUMMARIES.labels("cached").inc(r.summaries_cached)
    metrics.SUMMARIES.labels("generated").inc(r.summaries_generated)
    metrics.TRUNCATED_TOKENS.inc(r.truncated_tokens)
    if r.summary_fallback:
        metrics.SUMMARY_FALLBACKS.inc()


# --- the app -----------------------------------------------------------------------------------


def build_app() -> FastAPI:
    app = FastAPI(
        title="Flywheel",
        version="0.1.0",
        description="Code completion that learns from its users. OpenAI- and Tabby-compatible.",
    )

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        metrics.REQUESTS.labels(path, str(response.status_code)).inc()
        metrics.LATENCY.labels(path).observe(time.perf_counter() - t0)
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
        where = ".".join(str(x) for x in first.get("loc", ()) if x not in ("body", "openai", "tabby"))
        message = f"{where}: {first['msg']}" if where else first["msg"]
        return JSONResponse(
            status_code=422,
            content={
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "details": json.loads(json.dumps(errors, default=str)),
                }
            },
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = (
            "authentication_error"
            if exc.status_code == 401
            else "invalid_request_error"
            if exc.status_code < 500
            else "server_error"
        )
        return JSONResponse(
            status_code=exc.status_code,
            content={"error": {"message": exc.detail, "type": kind}},
            headers=getattr(exc, "headers", None),
        )

    @app.post(
        "/v1/completions", response_model=CompletionResponse, responses={401: {}, 404: {}, 413: {}, 422: {}, 503: {}}
    )
    async def completions(body: CompletionBody, st: StateDep, token: EditorToken, request: Request):
        """Complete code: OpenAI's request shape (prompt, suffix, ...) or Tabby's (language, segments)."""
        shape = "tabby" if isinstance(body, TabbyCompletionRequest) else "openai"
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        uhash = user_hash(body.user, fallback=token)
        gen = _to_generate(st, body, completion_id)
        replica = _pick(st, body, uhash)
        created = int(time.time())
        if isinstance(body, OpenAICompletionRequest) and body.stream:
            return StreamingResponse(_sse(st, replica, gen, body, uhash, created), media_type="text/event-stream")
        try:
            r = await replica.complete(gen)
        except Exception as e:  # the engine or its replica is down: the client may retry
            raise HTTPException(503, f"model replica unavailable: {type(e).__name__}") from e
        _record(st, r, uhash, body, shape)
        return _response(st, r, body, created)

    @app.post("/v1/events", response_model=EventAccepted, responses={401: {}, 422: {}})
    async def events(
        body: EventRequest,
        st: StateDep,
        _token: EditorToken,
        select_kind: Annotated[str | None, Query(pattern="^(full|line|word)$")] = None,
    ):
        """Record what the user did with a completion: view, select (full, line or word), dismiss, or edit."""
        kind = body.select_kind or select_kind
        try:
            event = FeedbackEvent(
                event_id=body.event_id or uuid.uuid4(),
                completion_id=body.completion_id,
                type=body.type,
                choice_index=body.choice_index,
                select_kind=kind if body.type == "select" else None,
                accepted_chars=body.accepted_chars,
                kept_text=body.kept_text,
                view_id=body.view_id,
                elapsed_ms=body.elapsed,
            )
        except ValueError as e:
            raise HTTPException(422, str(e).splitlines()[-1].strip()) from None
        st.producer.send(bus.EVENTS, event)
        metrics.EVENTS.labels(event.type).inc()
        return EventAccepted(event_id=event.event_id)

    @app.get("/v1/health")
    async def health(st: StateDep) -> dict:
        """Tabby's health report (public), with the pools' served and target versions."""
        rt = st.routing
        return {
            "model": st.cfg.model_name,
            "chat_model": None,
            "device": "cuda" if st.cfg.engine.num_gpus else "cpu",
            "arch": platform.machine(),
            "cpu_info": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "cuda_devices": [],
            "version": {"build_date": "", "git_describe": "flywheel-0.1.0", "git_sha": "", "build_timestamp": ""},
            "webserver": True,
            "flywheel": {
                "versions": rt.versions,
                "pools": {
                    p: {"serving": rt.serving.get(p), "target": rt.routes.target(p)} for p in POOLS if p in st.replicas
                },
                "canary_percent": rt.routes.canary_percent,
                "canary_live": rt.canary_live,
                "routing_checked_s_ago": round(time.time() - rt.checked_at, 1) if rt.checked_at else None,
                "routing_error": rt.error,
                "records_buffered": getattr(st.producer, "buffered", 0),
                "uptime_s": round(time.time() - st.started, 1),
            },
        }

    @app.get("/v1/models")
    async def models(st: StateDep, _token: EditorToken) -> dict:
        """The served model and its live versions (OpenAI shape)."""
        data = [{"id": st.cfg.model_name, "object": "model", "owned_by": "flywheel"}]
        data += [
            {"id": f"{st.cfg.model_name}@v{v}", "object": "model", "owned_by": "flywheel"} for v in st.routing.versions
        ]
        return {"object": "list", "data": data}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        """Prometheus metrics (requests, latency, tokens, summaries, producer buffer)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    from ops.dashboard import router as dashboard_router  # late: ops.dashboard imports this module

    app.include_router(dashboard_router)
    from ops.rollout.routes import router as rollout_router  # late, likewise; its database: app.state.database_url

    app.include_router(rollout_router())
    return app


async def _sse(st: ApiState, replica: ReplicaClient, gen: GenerateRequest, body, uhash: str, created: int):
    """OpenAI server-sent events: one chunk per text delta per choice, then `[DONE]`."""
    sent = {}
    final = None
    try:
        async for r in replica.stream(gen):
            final = r
            for s in r.samples:
                delta = s.text[len(sent.get(s.index, "")) :]
                finish = (s.finish_reason if s.finish_reason in ("stop", "length") else None) if r.done else None
                if delta or finish:
                    sent[s.index] = s.text
                    chunk = {
                        "id": r.completion_id,
                        "object": "text_completion",
                        "created": created,
                        "model": f"{st.cfg.model_name}@v{r.model_version}",
                        "choices": [{"index": s.index, "text": delta, "logprobs": None, "finish_reason": finish}],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n"
    except Exception as e:  # headers are sent: report in-band, as OpenAI does
        yield f"data: {json.dumps({'error': {'message': f'model replica failed: {type(e).__name__}', 'type': 'server_error'}})}\n\n"
        return
    if final is not None:
        _record(st, final, uhash, body, "openai")
    yield "data: [DONE]\n\n"
