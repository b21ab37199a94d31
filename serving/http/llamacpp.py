"""POST /infill: llama.cpp server's fill-in-the-middle endpoint, as llama.vscode and llama.vim call it.

The answer has the fields those plugins read: `content`, `stop`, `tokens_predicted`,
`tokens_evaluated`, `truncated`, `tokens_cached`, `generation_settings.n_ctx` and `timings`
(llama.vscode's status bar shows them), one object per completion, or an array when
`n_cmpl` asks for several. `stream: true` answers llama.cpp's server-sent events: `data:`
objects with the new `content`, the last with `stop: true` and the totals.

`n_predict: 0` is llama.vscode's warm-up, sent with the chunks it just collected so llama.cpp
can cache them: Flywheel builds the prompt as for a completion and prefills it on the replica
the user's requests go to (`completions.warm_up`: one greedy token, thrown away), so vLLM's
prefix cache holds it when the next request comes; the answer is empty (`tokens_cached` of a
later answer says how much of its prompt was cached), and nothing is recorded.
`t_max_predict_ms` ends a completion early, as llama.cpp does: once it has run that long and
every completion has reached a new line, what was written so far is the answer (and the record).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, HTTPException
from fastapi.responses import StreamingResponse

from feedback.schemas import cursor_context
from serving.engine import SamplingSpec
from serving.http.completions import (
    WARM_UP,
    RecordMeta,
    check_prompt_size,
    check_stops,
    complete,
    count_error,
    is_crlf,
    is_pinned,
    lf,
    max_tokens_for,
    new_completion_id,
    new_warm_up_id,
    pick,
    record,
    replica_error,
    warm_up,
)
from serving.http.deps import ApiState, CompletionsToken, ReplicaClient, StateDep
from serving.replica import GenerateRequest, GenerateResult
from serving.schemas import InfillRequest

router = APIRouter()


@router.post("/infill", responses={400: {}, 401: {}, 404: {}, 413: {}, 422: {}, 429: {}, 503: {}})
async def infill(body: InfillRequest, st: StateDep, token: CompletionsToken):
    """Fill in the middle in llama.cpp server's shape (input_prefix, input_suffix, input_extra, prompt)."""
    started = time.perf_counter()
    if body.n_cmpl > st.cfg.max_n:
        raise HTTPException(400, f"n_cmpl: {body.n_cmpl} completions asked, the limit is {st.cfg.max_n}")
    check_stops(st, body.stop, "stop")
    crlf = is_crlf(body.input_prefix, body.prompt, body.input_suffix)
    # The most recent chunk comes last; the prompt builder wants the most relevant first.
    context = tuple((c.filename, lf(c.text)) for c in reversed(body.input_extra))
    prefix, suffix = lf(body.input_prefix + body.prompt), lf(body.input_suffix)
    check_prompt_size(st, prefix, suffix, context)
    if body.n_predict == 0:
        gen = GenerateRequest(new_warm_up_id(), prefix, suffix, None, WARM_UP, context=context)
        _, replica = pick(st, body.model, st.caller_hash(token, None))
        return _warm_up(st, body, await warm_up(replica, gen))
    spec = SamplingSpec(
        n=body.n_cmpl,
        max_tokens=max_tokens_for(st, body.n_predict),
        temperature=body.temperature,
        top_p=body.top_p,
        seed=None if body.seed in (None, -1) else body.seed,
        stop=tuple(body.stop),
    )
    gen = GenerateRequest(new_completion_id(), prefix, suffix, None, spec, context=context)
    uhash = st.caller_hash(token, None)
    pool, replica = pick(st, body.model, uhash)
    meta = RecordMeta(
        uhash, "llamacpp", pool, started, pinned=is_pinned(body.model), cursor=cursor_context(prefix, suffix)
    )
    if body.stream:
        return StreamingResponse(_events(st, replica, gen, body, meta, crlf), media_type="text/event-stream")
    if body.t_max_predict_ms:
        try:
            r = None
            async for r in _generation(replica, gen, body.t_max_predict_ms):
                pass
        except Exception as e:  # the engine or its replica is down: the client may retry
            raise replica_error(st, pool, e) from e
        if r is None:  # a stream that ended without a result: the replica went away
            count_error(st, pool, "replica_failed")
            raise HTTPException(503, "model replica unavailable: it answered nothing")
    else:
        r = await complete(st, meta, replica, gen)
    record(st, r, meta)
    answers = [_answer(st, body, r, s, crlf) for s in r.samples]
    return answers[0] if body.n_cmpl == 1 else answers


async def _generation(
    replica: ReplicaClient, gen: GenerateRequest, t_max_ms: int | None
) -> AsyncIterator[GenerateResult]:
    """The replica's cumulative results; after `t_max_ms`, the first one in which every completion
    has a new line is the last (its unfinished completions end with reason "length")."""
    deadline = time.monotonic() + t_max_ms / 1000 if t_max_ms else None
    stream = replica.stream(gen)
    try:
        async for r in stream:
            if (
                deadline is not None
                and not r.done
                and time.monotonic() > deadline
                and all("\n" in s.text or s.finish_reason for s in r.samples)
            ):
                cut = [dataclasses.replace(s, finish_reason=s.finish_reason or "length") for s in r.samples]
                yield dataclasses.replace(r, samples=cut, done=True)
                return
            yield r
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:  # ends the request on the replica (vLLM aborts it)
            await close()


def _answer(st: ApiState, body: InfillRequest, r: GenerateResult, s, crlf: bool) -> dict:
    text = s.text.replace("\n", "\r\n") if crlf else s.text
    seconds = max(r.latency_ms, 1e-3) / 1000
    return {
        "index": s.index,
        "content": text,
        "id_slot": 0,
        "stop": True,
        "model": f"{st.cfg.model_name}@v{r.model_version}",
        "tokens_predicted": len(s.token_ids),
        "tokens_evaluated": len(r.prompt_token_ids),
        "generation_settings": _settings(st, body),
        "prompt": "",
        "has_new_line": "\n" in s.text,
        "truncated": r.truncated_tokens > 0 or bool(r.summary_ids),
        "stop_type": "limit" if s.finish_reason == "length" else "eos",
        "stopping_word": "",
        "tokens_cached": r.cached_tokens,
        "timings": {
            "prompt_n": len(r.prompt_token_ids),
            "predicted_n": len(s.token_ids),
            "predicted_ms": r.latency_ms,
            "predicted_per_second": len(s.token_ids) / seconds,
        },
        "completion_id": r.completion_id,
    }


def _settings(st: ApiState, body: InfillRequest) -> dict:
    window = st.prompt_format.get("window") or st.cfg.engine.max_model_len
    return {
        "n_ctx": min(window, st.cfg.engine.max_model_len),
        "n_predict": body.n_predict,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "model": st.cfg.model_name,
    }


def _warm_up(st: ApiState, body: InfillRequest, r: GenerateResult) -> dict:
    """llama.cpp's answer to `n_predict: 0`: no content, the prompt evaluated (its thrown-away
    token is not reported)."""
    return {
        "index": 0,
        "content": "",
        "id_slot": 0,
        "stop": True,
        "model": f"{st.cfg.model_name}@v{r.model_version}",
        "tokens_predicted": 0,
        "tokens_evaluated": len(r.prompt_token_ids),
        "generation_settings": _settings(st, body),
        "prompt": "",
        "has_new_line": False,
        "truncated": r.truncated_tokens > 0 or bool(r.summary_ids),
        "stop_type": "limit",
        "stopping_word": "",
        "tokens_cached": r.cached_tokens,
        "timings": {
            "prompt_n": len(r.prompt_token_ids),
            "prompt_ms": r.latency_ms,
            "predicted_n": 0,
            "predicted_ms": 0.0,
        },
    }


async def _events(
    st: ApiState, replica: ReplicaClient, gen: GenerateRequest, body: InfillRequest, meta: RecordMeta, crlf: bool
):
    """llama.cpp's server-sent events: the new content of each completion as it grows, then one
    event per completion with `stop: true` and its totals."""
    sent: dict[int, str] = {}
    final = None
    try:
        async for r in _generation(replica, gen, body.t_max_predict_ms):
            final = r
            for s in r.samples:
                delta = s.text[len(sent.get(s.index, "")) :]
                if delta:
                    sent[s.index] = s.text
                    text = delta.replace("\n", "\r\n") if crlf else delta
                    yield f"data: {json.dumps({'index': s.index, 'content': text, 'stop': False})}\n\n"
    except Exception as e:  # headers are sent: report in-band
        count_error(st, meta.pool, "stream_failed")
        yield f"data: {json.dumps({'error': {'message': f'model replica failed: {type(e).__name__}', 'type': 'server_error'}})}\n\n"
        return
    if final is None:
        return
    record(st, final, meta)
    for s in final.samples:
        yield f"data: {json.dumps({**_answer(st, body, final, s, crlf), 'content': ''})}\n\n"
