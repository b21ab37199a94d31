"""POST /v1/completions: OpenAI's and Tabby's request shapes, answered whole or as SSE; and what
every completion route shares (serving/http/llamacpp.py, serving/http/ollama.py).

Every served completion is recorded to `flywheel.completions`, tagged with the version that
produced it, through a buffered producer that never holds up a request. The record keeps the
file's text either side of the cursor (bounded, `cursor_context`): the sink reads from the next
request in the same file whether this suggestion was kept (feedback/implicit.py), for clients
that send no events. The pool comes from
the routing state (serving/http/routing.py), or from a pinned `model: name@vN`.

Clients that render the model's FIM template themselves (Continue) send it as a plain `prompt`;
it is read back (learner.formats.parse_rendered_fim) and prompted the server's way, so the
served model's own template, the file header and self-summarization apply. Tabby's declarations
and snippets go into the prompt as other files of the repository; its text keeps the file's
line endings (CRLF in, CRLF out), and its suggestions end at the language's next top-level
definition (learner/languages.py).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import Discriminator, Tag
from ray.serve.exceptions import BackPressureError

from feedback import bus
from feedback.schemas import CompletionChoice, CompletionRecord, cursor_context
from learner.formats import parse_rendered_fim
from learner.languages import editor_stops, language
from serving import metrics
from serving.engine import SamplingSpec
from serving.http.deps import ApiState, CompletionsToken, ReplicaClient, StateDep
from serving.http.timing import Stages, stages
from serving.replica import GenerateRequest, GenerateResult
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
    started = time.perf_counter()
    shape = "tabby" if isinstance(body, TabbyCompletionRequest) else "openai"
    completion_id = new_completion_id()
    uhash = st.caller_hash(token, body.user)
    if isinstance(body, TabbyCompletionRequest):
        gen, crlf = _tabby_request(st, body, completion_id), is_crlf(body.segments.prefix, body.segments.suffix)
        filepath, lang = body.segments.filepath, body.language
    else:
        gen, crlf = _openai_request(st, body, completion_id), False
        filepath, lang = gen.path, None
    pool, replica = pick(st, getattr(body, "model", None), uhash)
    created = int(time.time())
    meta = RecordMeta(
        uhash,
        shape,
        pool,
        started,
        lang,
        filepath,
        is_pinned(getattr(body, "model", None)),
        cursor_context(gen.prefix, gen.suffix),
    )
    timing = stages(request)
    if timing is not None:
        timing.add("parse", (started - timing.arrived) * 1000)
        timing.add("route", (time.perf_counter() - started) * 1000)
    if isinstance(body, OpenAICompletionRequest) and body.stream:
        return StreamingResponse(_sse(st, replica, gen, meta, created), media_type="text/event-stream")
    called = time.perf_counter()
    r = await complete(st, meta, replica, gen)
    answered = time.perf_counter()
    record(st, r, meta)
    if timing is not None:
        mark_replica_stages(timing, r, (answered - called) * 1000)
        timing.add("record", (time.perf_counter() - answered) * 1000)
    response = _response(st, r, body, created, crlf=crlf)
    if timing is not None:
        timing.returned = time.perf_counter()
    return response


# --- what every completion route shares ----------------------------------------------------------


@dataclass(frozen=True)
class RecordMeta:
    """What a completion's record says of its request, besides what the replica returned."""

    user_hash: str
    shape: str  # the request shape, for flywheel_completions_total{shape}
    pool: str  # the pool that answers (pick), for the per-pool latency and errors
    started: float  # time.perf_counter() when the request arrived: latency is counted from it
    language: str | None = None
    filepath: str | None = None
    pinned: bool = False
    cursor: tuple[str, str] | None = None  # the file's text either side of the cursor (feedback.schemas.cursor_context)


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def check_prompt_size(st: ApiState, prefix: str, suffix: str | None, context=()) -> None:
    """413 for a prompt over serve.max_prompt_chars (prefix, suffix and other files together)."""
    size = len(prefix) + len(suffix or "") + sum(len(text) for _, text in context)
    if size > st.cfg.max_prompt_chars:
        raise HTTPException(413, f"prompt of {size} characters exceeds the limit of {st.cfg.max_prompt_chars}")


def check_stops(st: ApiState, stops: list[str], field: str) -> None:
    """422 for more stop strings than serve.max_stop_strings."""
    if len(stops) > st.cfg.max_stop_strings:
        raise HTTPException(
            422, f"{field}: {len(stops)} stop strings, more than the limit of {st.cfg.max_stop_strings}"
        )


def client_prompt(prompt: str) -> tuple[str, str | None, str | None, str | None, tuple[tuple[str, str], ...]]:
    """A prompt sent without a suffix, as (prefix, suffix, path, repo, other files): read back
    when a client rendered it in a FIM template, else a plain continuation (suffix None). The
    other files nearest the current one come first, as the prompt builder ranks them."""
    parsed = parse_rendered_fim(prompt)
    if parsed is None:
        return prompt, None, None, None, ()
    return parsed.prefix, parsed.suffix, parsed.path, parsed.repo, tuple(reversed(parsed.context))


def lf(text: str) -> str:
    """Windows line endings as the model was trained on them: one newline."""
    return text.replace("\r\n", "\n")


def is_crlf(*texts: str | None) -> bool:
    """Whether the file uses Windows line endings, so the suggestion must too."""
    return any("\r\n" in (t or "") for t in texts)


def max_tokens_for(st: ApiState, n: int | None) -> int:
    """A llama.cpp or Ollama token limit as max_tokens: unset, the default; negative ("until the
    end"), serve.max_tokens_limit; larger than that, cut to it (those servers never refuse a
    limit, they stop at the context's end)."""
    if n is None:
        return st.cfg.default_max_tokens
    return st.cfg.max_tokens_limit if n < 0 else min(n, st.cfg.max_tokens_limit)


def mark_replica_stages(timing: Stages, r: GenerateResult, call_ms: float) -> None:
    """The replica call's share of a request's stages (serving/http/timing.py): the replica's own
    prompt building and engine time, and the rest of the call as the hop to it and back."""
    timing.add("hop", call_ms - r.latency_ms)
    timing.add("prompt", r.prompt_ms)
    timing.add("engine", r.latency_ms - r.prompt_ms)
    if r.first_token_ms is not None:
        timing.add("ttft", r.first_token_ms - r.prompt_ms)


async def complete(st: ApiState, meta: RecordMeta, replica: ReplicaClient, gen: GenerateRequest) -> GenerateResult:
    try:
        return await replica.complete(gen)
    except Exception as e:  # the engine or its replica is down: the client may retry
        raise replica_error(st, meta.pool, e) from e


WARM_UP = SamplingSpec(max_tokens=1, temperature=0.0, stream=False)
"""A warm-up's generation: vLLM generates at least one token, so the prompt is prefilled and one
greedy token thrown away. The prompt's KV blocks stay in the replica's prefix cache, where the
next request with the same prefix finds them."""


def new_warm_up_id() -> str:
    return f"warmup-{uuid.uuid4().hex}"


async def warm_up(replica: ReplicaClient, gen: GenerateRequest) -> GenerateResult:
    """Prefill `gen`'s prompt (built as a completion's would be) on `replica` and throw the token
    away: nothing is answered, recorded or rewarded. A client sends one (llama.vscode's
    `n_predict: 0`, Ollama's `num_predict: 0`) so that its next request finds the prompt cached."""
    try:
        return await replica.complete(dataclasses.replace(gen, spec=WARM_UP))
    except Exception as e:  # the engine or its replica is down: the client may retry
        raise HTTPException(503, f"model replica unavailable: {type(e).__name__}") from e


BUSY_RETRY_S = 1
"""Retry-After when the pool's queue is full: a CPU replica finishes a completion in about that long."""


def replica_error(st: ApiState, pool: str, e: Exception) -> HTTPException:
    """503 for a failed replica call, counted: "busy" with Retry-After when the pool's queue is
    full (serve.max_queued_requests; Ray Serve's BackPressureError), else "unavailable"."""
    if isinstance(e, BackPressureError):
        count_error(st, pool, "busy")
        # A pool that has not reported its version yet is starting (or too busy to answer the poll).
        why = "at capacity" if st.routing.serving.get(pool) is not None else "not ready yet (starting, or at capacity)"
        return HTTPException(
            503,
            f"the {pool} replicas are {why}: serve.max_queued_requests are waiting; retry shortly",
            headers={"Retry-After": str(BUSY_RETRY_S)},
        )
    count_error(st, pool, "replica_failed")
    return HTTPException(503, f"model replica unavailable: {type(e).__name__}")


def count_error(st: ApiState, pool: str, reason: str) -> None:
    """A request the pool failed, under the version the pool reported last (the failed call
    carries none)."""
    served = st.routing.serving.get(pool)
    metrics.by_version(metrics.COMPLETION_ERRORS, str(served) if served is not None else "unknown", pool, reason).inc()


# --- request translation -----------------------------------------------------------------------


def _openai_request(st: ApiState, body: OpenAICompletionRequest, completion_id: str) -> GenerateRequest:
    cfg = st.cfg
    if body.n > cfg.max_n:
        raise HTTPException(400, f"n={body.n} exceeds the limit of {cfg.max_n}")
    max_tokens = body.max_tokens or cfg.default_max_tokens
    if max_tokens > cfg.max_tokens_limit:
        raise HTTPException(400, f"max_tokens={max_tokens} exceeds the limit of {cfg.max_tokens_limit}")
    check_stops(st, body.stop_list, "stop")
    spec = SamplingSpec(
        n=body.n,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=tuple(body.stop_list),
        top_logprobs=body.logprobs or 0,
    )
    if body.suffix:
        prefix, suffix, path, repo, context = body.prompt_text, body.suffix, None, None, ()
    else:
        prefix, suffix, path, repo, context = client_prompt(body.prompt_text)
        if suffix is None:
            suffix = body.suffix  # "" stays fill-in-the-middle with nothing after the cursor
    check_prompt_size(st, prefix, suffix, context)
    return GenerateRequest(completion_id, prefix, suffix, path, spec, repo=repo, context=context)


def _tabby_request(st: ApiState, body: TabbyCompletionRequest, completion_id: str) -> GenerateRequest:
    if body.mode == "next_edit_suggestion":
        raise HTTPException(
            400,
            "mode: next-edit prediction (next_edit_suggestion) is not supported; Flywheel completes "
            "at the cursor (mode: standard)",
        )
    seg, lang = body.segments, language(body.language)
    prefix, suffix = lf(seg.prefix), lf(seg.suffix or "")
    temperature = body.temperature if body.temperature is not None else 0.2
    spec = SamplingSpec(
        n=1,
        max_tokens=st.cfg.default_max_tokens,
        temperature=temperature,
        seed=body.seed,
        stop=editor_stops(body.language, prefix),
    )
    context = tuple((d.filepath, lf(d.body)) for d in seg.declarations or ())
    for snippets in (seg.relevant_snippets_from_changed_files, seg.relevant_snippets_from_recently_opened_files):
        # Tabby's agent ranks them; a score, where it sends one, ranks them here too.
        ranked = sorted(snippets or (), key=lambda s: -(s.score or 0.0))
        context += tuple((s.filepath, lf(s.body)) for s in ranked)
    check_prompt_size(st, prefix, suffix, context)
    return GenerateRequest(
        completion_id,
        prefix,
        suffix,
        seg.filepath,
        spec,
        repo=_repo_name(seg.git_url),
        context=context,
        comment=lang.comment,
    )


def _repo_name(git_url: str | None) -> str | None:
    """The repository's name in a Tabby request's git_url (`https://host/org/name.git` -> `name`)."""
    if not git_url:
        return None
    return git_url.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1].removesuffix(".git") or None


def is_pinned(model: str | None) -> bool:
    """Whether the request names its version (`model: name@vN`) instead of taking its route."""
    return "@v" in (model or "")


def pick(st: ApiState, model: str | None, uhash: str) -> tuple[str, ReplicaClient]:
    """The pool for this request (its name and client): the one serving a pinned `model: name@vN`,
    else the user's route."""
    model = model or ""
    if is_pinned(model):
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


def _response(st: ApiState, r: GenerateResult, body, created: int, *, crlf: bool = False) -> CompletionResponse:
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
        finish = client_finish(s.finish_reason)
        text = s.text.replace("\n", "\r\n") if crlf else s.text
        choices.append(Choice(index=s.index, text=text, logprobs=lp, finish_reason=finish))
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


def client_finish(reason: str | None) -> str | None:
    """A choice's finish_reason as OpenAI's clients know them: a suggestion the confidence gate
    withheld (learner/confidence.py) ended, empty: "stop"."""
    return "stop" if reason == "withheld" else reason if reason in ("stop", "length") else None


def _routing(st: ApiState, r: GenerateResult) -> str | None:
    """The record's routing trace, counted; one longer than `serve.max_routing_chars` is left out,
    so a big model's record stays within Kafka's message size (the learner routes those tokens itself)."""
    trace = r.samples[0].routing if r.samples else None
    if trace is not None and len(trace) > st.cfg.max_routing_chars:
        metrics.ROUTES.labels("too_long").inc()
        return None
    metrics.ROUTES.labels("carried" if trace is not None else "absent").inc()
    return trace


def record(st: ApiState, r: GenerateResult, meta: RecordMeta) -> None:
    """Count the completion (its latency up to now: a stream records at its end) and hand its
    record to the producer (never blocks, never raises)."""
    rec = CompletionRecord(
        completion_id=r.completion_id,
        model_version=r.model_version,
        user_hash=meta.user_hash,
        language=meta.language,
        filepath=meta.filepath,
        prompt_token_ids=r.prompt_token_ids,
        choices=[
            CompletionChoice(
                index=s.index,
                token_ids=s.token_ids,
                logprobs=[min(lp, 0.0) for lp in s.logprobs],
                text=s.text,
                finish_reason=s.finish_reason if s.finish_reason in ("stop", "length", "abort", "withheld") else None,
            )
            for s in r.samples
        ],
        summary_ids=r.summary_ids,
        latency_ms=r.latency_ms,
        prompt_text=st.decode(r.prompt_token_ids, skip_special_tokens=False),
        routing=_routing(st, r),
        before_cursor=meta.cursor[0] if meta.cursor is not None else None,
        after_cursor=meta.cursor[1] if meta.cursor is not None else None,
        pinned=meta.pinned,
    )
    st.producer.send(bus.COMPLETIONS, rec)
    v = str(r.model_version)
    metrics.by_version(metrics.COMPLETION_LATENCY, v, meta.pool).observe(time.perf_counter() - meta.started)
    if r.first_token_ms is not None:
        metrics.by_version(metrics.FIRST_TOKEN, v, meta.pool).observe(r.first_token_ms / 1000)
    metrics.by_version(metrics.COMPLETIONS, v, meta.shape).inc()
    metrics.TOKENS.labels("prompt").inc(len(r.prompt_token_ids))
    metrics.TOKENS.labels("completion").inc(sum(len(s.token_ids) for s in r.samples))
    if all(not s.text for s in r.samples):
        metrics.by_version(metrics.EMPTY, v).inc()
    if withheld := sum(s.finish_reason == "withheld" for s in r.samples):
        metrics.by_version(metrics.WITHHELD, v).inc(withheld)
    metrics.SUMMARIES.labels("cached").inc(r.summaries_cached)
    metrics.SUMMARIES.labels("generated").inc(r.summaries_generated)
    metrics.SUMMARIES.labels("skipped").inc(r.summaries_skipped)
    metrics.SUMMARIES.labels("deferred").inc(r.summaries_deferred)
    metrics.TRUNCATED_TOKENS.inc(r.truncated_tokens)
    if r.summary_fallback:
        metrics.SUMMARY_FALLBACKS.inc()


async def _sse(st: ApiState, replica: ReplicaClient, gen: GenerateRequest, meta: RecordMeta, created: int):
    """OpenAI server-sent events: one chunk per text delta per choice, then `[DONE]`."""
    sent = {}
    final = None
    try:
        async for r in replica.stream(gen):
            final = r
            for s in r.samples:
                delta = s.text[len(sent.get(s.index, "")) :]
                finish = client_finish(s.finish_reason) if r.done else None
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
        count_error(st, meta.pool, "stream_failed")
        yield f"data: {json.dumps({'error': {'message': f'model replica failed: {type(e).__name__}', 'type': 'server_error'}})}\n\n"
        return
    if final is not None:
        record(st, final, meta)
    yield "data: [DONE]\n\n"
