"""Ollama's API, as code-completion plugins use it (Twinny; Continue's Ollama provider).

    POST /api/generate   prompt [+ suffix], options {num_predict, temperature, top_p, stop, seed};
                         `stream` (default true) answers NDJSON: one object per text delta with
                         `response` and `done: false`, then one with `done: true`, `done_reason`
                         and the counts; `stream: false` answers that last object with the whole
                         `response`
    GET  /api/tags       the model and its live versions (`flywheel:v3` pins a version)
    POST /api/show       the model's window (`model_info`), whether it fills in the middle
                         (`capabilities` has "insert"), its FIM layout as an Ollama `template`
    GET  /api/version    the Ollama API version these routes answer like (public, as Ollama's)

A request with an empty prompt and no suffix is Ollama's "load the model" call: answered at
once with `done_reason: "load"`, nothing generated or recorded. One with `num_predict: 0` is a
warm-up: its prompt is prefilled on the user's replica (completions.warm_up), so the next
request with the same prefix finds it in vLLM's prefix cache; nothing is answered or recorded.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

from fastapi import APIRouter, HTTPException
from fastapi.responses import StreamingResponse

from feedback.core.auth import EditorToken
from feedback.schemas import cursor_context
from learner.formats import FIM_TEMPLATES, FimTemplate
from serving.engine import SamplingSpec
from serving.http.completions import (
    WARM_UP,
    RecordMeta,
    check_prompt_size,
    check_stops,
    client_prompt,
    complete,
    count_error,
    is_pinned,
    max_tokens_for,
    new_completion_id,
    new_warm_up_id,
    pick,
    record,
    warm_up,
)
from serving.http.deps import ApiState, CompletionsToken, ReplicaClient, StateDep
from serving.replica import GenerateRequest, GenerateResult
from serving.schemas import OllamaGenerateRequest, OllamaShowRequest

OLLAMA_VERSION = "0.6.0"
"""The Ollama release whose /api/generate these routes answer like (`suffix`, `raw`, `options`):
clients that check the version before sending a suffix find it new enough."""

router = APIRouter()


@router.post("/api/generate", responses={400: {}, 401: {}, 404: {}, 413: {}, 422: {}, 429: {}, 503: {}})
async def generate(body: OllamaGenerateRequest, st: StateDep, token: CompletionsToken):
    """Complete code in Ollama's shape; NDJSON unless `stream` is false."""
    started = time.perf_counter()
    opts = body.options
    stops = list(opts.stop or [])
    check_stops(st, stops, "options.stop")
    if body.suffix is not None:
        prefix, suffix, path, repo, context = body.prompt, body.suffix, None, None, ()
    else:
        prefix, suffix, path, repo, context = client_prompt(body.prompt)
    check_prompt_size(st, prefix, suffix, context)
    pinned = _pinned_name(st, body.model)
    if not body.prompt and body.suffix is None:
        return _done(body.model, "", "load")
    uhash = st.caller_hash(token, None)
    if opts.num_predict == 0:  # a warm-up: the prompt prefilled into the replica's prefix cache
        _, replica = pick(st, pinned, uhash)
        gen = GenerateRequest(new_warm_up_id(), prefix, suffix, path, WARM_UP, repo=repo, context=context)
        r = await warm_up(replica, gen)
        return {**_done(body.model, "", "length"), "prompt_eval_count": len(r.prompt_token_ids), "eval_count": 0}
    spec = SamplingSpec(
        max_tokens=max_tokens_for(st, opts.num_predict),
        temperature=opts.temperature if opts.temperature is not None else 0.2,
        top_p=opts.top_p if opts.top_p is not None else 1.0,
        seed=None if opts.seed in (None, -1) else opts.seed,
        stop=tuple(stops),
    )
    gen = GenerateRequest(new_completion_id(), prefix, suffix, path, spec, repo=repo, context=context)
    pool, replica = pick(st, pinned, uhash)
    meta = RecordMeta(
        uhash, "ollama", pool, started, filepath=path, pinned=is_pinned(pinned), cursor=cursor_context(prefix, suffix)
    )
    if body.stream:
        return StreamingResponse(_lines(st, replica, gen, body.model, meta), media_type="application/x-ndjson")
    r = await complete(st, meta, replica, gen)
    record(st, r, meta)
    return _final(body.model, r, r.samples[0].text if r.samples else "")


@router.get("/api/tags")
async def tags(st: StateDep, _token: EditorToken) -> dict:
    """The served model and its live versions, as Ollama lists its local models."""
    names = [f"{st.cfg.model_name}:latest", *(f"{st.cfg.model_name}:v{v}" for v in st.routing.versions)]
    modified, details = _now(st.started), _details(st)
    return {
        "models": [
            {"name": n, "model": n, "modified_at": modified, "size": 0, "digest": "", "details": details} for n in names
        ]
    }


@router.post("/api/show", responses={401: {}, 404: {}, 422: {}})
async def show(body: OllamaShowRequest, st: StateDep, _token: EditorToken) -> dict:
    """What Ollama clients read of a model before they prompt it: its context window, and whether
    (and how) it takes a suffix."""
    name = body.model or body.name or ""
    if name.partition(":")[0] != st.cfg.model_name:
        raise HTTPException(404, f"model {name!r} not found; this server serves {st.cfg.model_name!r}")
    fim = next((t for t in FIM_TEMPLATES if t.name == st.prompt_format.get("fim")), None)
    window = min(st.prompt_format.get("window") or st.cfg.engine.max_model_len, st.cfg.engine.max_model_len)
    return {
        "modelfile": "",
        "parameters": "",
        "template": _template(fim),
        "details": _details(st),
        "model_info": {"general.architecture": "flywheel", "flywheel.context_length": window},
        "capabilities": ["completion", "insert"] if fim else ["completion"],
    }


def _template(fim: FimTemplate | None) -> str:
    """The served model's FIM layout in Ollama's template notation (what a client would render)."""
    if fim is None:
        return "{{ .Prompt }}"
    if fim.suffix_first:
        return f"{{{{ if .Suffix }}}}{fim.suffix}{{{{ .Suffix }}}}{fim.prefix}{{{{ end }}}}{{{{ .Prompt }}}}"
    middle = fim.middle or ""
    return (
        f"{{{{ if .Suffix }}}}{fim.prefix}{{{{ .Prompt }}}}{fim.suffix}{{{{ .Suffix }}}}{middle}"
        "{{ else }}{{ .Prompt }}{{ end }}"
    )


def _details(st: ApiState) -> dict:
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": st.prompt_format.get("fim") or "",
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }


@router.get("/api/version")
async def version() -> dict:
    return {"version": OLLAMA_VERSION}


def _pinned_name(st: ApiState, model: str) -> str | None:
    """Ollama's `name:vN` as Flywheel's `name@vN`; any other name (`flywheel:latest`, the model a
    client was set up with) takes the user's route."""
    name, _, tag = model.rpartition(":")
    if name == st.cfg.model_name and tag[:1] == "v" and tag[1:].isdigit():
        return f"{name}@{tag}"
    return None


def _now(t: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).isoformat().replace("+00:00", "Z")


def _done(model: str, text: str, reason: str) -> dict:
    return {"model": model, "created_at": _now(), "response": text, "done": True, "done_reason": reason}


def _final(model: str, r: GenerateResult, text: str) -> dict:
    s = r.samples[0] if r.samples else None
    ns = int(r.latency_ms * 1e6)
    return {
        **_done(model, text, "length" if s is not None and s.finish_reason == "length" else "stop"),
        "context": [],
        "total_duration": ns,
        "load_duration": 0,
        "prompt_eval_count": len(r.prompt_token_ids),
        "eval_count": len(s.token_ids) if s is not None else 0,
        "eval_duration": ns,
        "completion_id": r.completion_id,
    }


async def _lines(st: ApiState, replica: ReplicaClient, gen: GenerateRequest, model: str, meta: RecordMeta):
    """Ollama's NDJSON stream: a line per text delta, then the final line with the counts."""
    sent, final = "", None
    try:
        async for r in replica.stream(gen):
            final = r
            text = r.samples[0].text if r.samples else ""
            if len(text) > len(sent):
                delta, sent = text[len(sent) :], text
                yield json.dumps({"model": model, "created_at": _now(), "response": delta, "done": False}) + "\n"
    except Exception as e:  # headers are sent: report in-band, as Ollama does
        count_error(st, meta.pool, "stream_failed")
        yield json.dumps({"error": f"model replica failed: {type(e).__name__}"}) + "\n"
        return
    if final is not None:
        record(st, final, meta)
        yield json.dumps(_final(model, final, "")) + "\n"
