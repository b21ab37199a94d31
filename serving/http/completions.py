"""POST /v1/completions: OpenAI's and Tabby's request shapes, answered whole or as SSE.

Every served completion is recorded to `flywheel.completions`, tagged with the version that
produced it, through a buffered producer that never holds up a request. The pool comes from
the routing state (serving/http/routing.py), or from a pinned `model: name@vN`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import Discriminator, Tag

from feedback import bus
from feedback.schemas import CompletionChoice, CompletionRecord
from learner.prompts import EDITOR_STOP
from serving import metrics
from serving.engine import SamplingSpec
from serving.http.deps import ApiState, CompletionsToken, ReplicaClient, StateDep
from serving.replica import GenerateRequest, GenerateResult
from serving.routing import user_hash
from serving.schemas import (
    Choice,
    CompletionResponse,
    LogProbs,
    OpenAICompletionRequest,
    TabbyCompletionRequest,
    Usage,
)


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


router = APIRouter()


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={400: {}, 401: {}, 404: {}, 413: {}, 422: {}, 429: {}, 503: {}},
)
async def completions(body: CompletionBody, st: StateDep, token: CompletionsToken, request: Request):
    """Complete code: OpenAI's request shape (prompt, suffix, ...) or Tabby's (language, segments)."""
    t0 = time.perf_counter()
    shape = "tabby" if isinstance(body, TabbyCompletionRequest) else "openai"
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    uhash = user_hash(st.cfg.user_hash_key(), token=token, user=body.user)
    gen = _to_generate(st, body, completion_id)
    pool, replica = _pick(st, body, uhash)
    created = int(time.time())
    if isinstance(body, OpenAICompletionRequest) and body.stream:
        return StreamingResponse(_sse(st, pool, replica, gen, body, uhash, created, t0), media_type="text/event-stream")
    try:
        r = await replica.complete(gen)
    except Exception as e:  # the engine or its replica is down: the client may retry
        _count_error(st, pool, "replica_failed")
        raise HTTPException(503, f"model replica unavailable: {type(e).__name__}") from e
    _record(st, r, uhash, body, shape, pool)
    response = _response(st, r, body, created)
    metrics.by_version(metrics.COMPLETION_LATENCY, str(r.model_version), pool).observe(time.perf_counter() - t0)
    return response


# --- request translation -----------------------------------------------------------------------


def _to_generate(
    st: ApiState, body: OpenAICompletionRequest | TabbyCompletionRequest, completion_id: str
) -> GenerateRequest:
    cfg = st.cfg
    if isinstance(body, TabbyCompletionRequest):
        seg = body.segments
        prefix, suffix, path, repo = seg.prefix, seg.suffix or "", seg.filepath, _repo_name(seg.git_url)
        temperature = body.temperature if body.temperature is not None else 0.2
        spec = SamplingSpec(
            n=1, max_tokens=cfg.default_max_tokens, temperature=temperature, seed=body.seed, stop=(EDITOR_STOP,)
        )
    else:
        prefix, suffix, path, repo = body.prompt_text, body.suffix, None, None
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
    return GenerateRequest(completion_id=completion_id, prefix=prefix, suffix=suffix, path=path, spec=spec, repo=repo)


def _repo_name(git_url: str | None) -> str | None:
    """The repository's name in a Tabby request's git_url (`https://host/org/name.git` -> `name`)."""
    if not git_url:
        return None
    return git_url.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1].removesuffix(".git") or None


def _is_pinned(body) -> bool:
    """Whether the request names its version (`model: name@vN`) instead of taking its route."""
    return "@v" in (getattr(body, "model", None) or "")


def _pick(st: ApiState, body, uhash: str) -> tuple[str, ReplicaClient]:
    """The pool for this request (its name and client): the one serving a pinned `model: name@vN`,
    else the user's route."""
    model = getattr(body, "model", None) or ""
    if _is_pinned(body):
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
    return pool, st.replicas[pool]


def _count_error(st: ApiState, pool: str, reason: str) -> None:
    """A request the pool failed, under the version the pool reported last (the failed call
    carries none)."""
    served = st.routing.serving.get(pool)
    metrics.by_version(metrics.COMPLETION_ERRORS, str(served) if served is not None else "unknown", pool, reason).inc()


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


def _record(st: ApiState, r: GenerateResult, uhash: str, body, shape: str, pool: str) -> None:
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
        pinned=_is_pinned(body),
    )
    st.producer.send(bus.COMPLETIONS, record)
    v = str(r.model_version)
    metrics.by_version(metrics.COMPLETIONS, v, shape).inc()
    metrics.TOKENS.labels("prompt").inc(len(r.prompt_token_ids))
    metrics.TOKENS.labels("completion").inc(sum(len(s.token_ids) for s in r.samples))
    if all(not s.text for s in r.samples):
        metrics.by_version(metrics.EMPTY, v).inc()
    metrics.SUMMARIES.labels("cached").inc(r.summaries_cached)
    metrics.SUMMARIES.labels("generated").inc(r.summaries_generated)
    metrics.SUMMARIES.labels("skipped").inc(r.summaries_skipped)
    metrics.TRUNCATED_TOKENS.inc(r.truncated_tokens)
    if r.summary_fallback:
        metrics.SUMMARY_FALLBACKS.inc()
    if r.first_token_ms is not None:
        metrics.by_version(metrics.FIRST_TOKEN, v, pool).observe(r.first_token_ms / 1000)


async def _sse(
    st: ApiState, pool: str, replica: ReplicaClient, gen: GenerateRequest, body, uhash: str, created: int, t0: float
):
    """OpenAI server-sent events: one chunk per text delta per choice, then `[DONE]`; the latency
    counted is the request's, up to `[DONE]`."""
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
        _count_error(st, pool, "stream_failed")
        yield f"data: {json.dumps({'error': {'message': f'model replica failed: {type(e).__name__}', 'type': 'server_error'}})}\n\n"
        return
    if final is not None:
        _record(st, final, uhash, body, "openai", pool)
    yield "data: [DONE]\n\n"
    if final is not None:
        metrics.by_version(metrics.COMPLETION_LATENCY, str(final.model_version), pool).observe(time.perf_counter() - t0)
