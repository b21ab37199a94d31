"""GET /v1/health (Tabby's health report, public), /v1/models (OpenAI shape), /metrics (Prometheus)."""

from __future__ import annotations

import os
import platform
import time

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from feedback.core.auth import EditorToken
from feedback.pools import POOLS
from serving.http.deps import StateDep

router = APIRouter()


@router.get("/v1/health")
async def health(st: StateDep) -> dict:
    """Tabby's health report (public), with the pools' served and target versions and how the model
    is prompted (its FIM template, or prefix-only)."""
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
            # Public: that the targets are unreadable, never the driver's message (host, user, database).
            "routing_error": "the serving targets could not be read; see the server log" if rt.error else None,
            "prompt_format": st.prompt_format,
            "records_buffered": getattr(st.producer, "buffered", 0),
            "uptime_s": round(time.time() - st.started, 1),
        },
    }


@router.get("/v1/models")
async def models(st: StateDep, _token: EditorToken) -> dict:
    """The served model and its live versions (OpenAI shape)."""
    data = [{"id": st.cfg.model_name, "object": "model", "owned_by": "flywheel"}]
    data += [
        {"id": f"{st.cfg.model_name}@v{v}", "object": "model", "owned_by": "flywheel"} for v in st.routing.versions
    ]
    return {"object": "list", "data": data}


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus() -> PlainTextResponse:
    """Prometheus metrics of this ingress (requests, latency, completion latency, time to first token
    and errors by version and pool, tokens, summaries, producer buffer); the replicas' are exported
    by Ray's metrics agent (serving/metrics.py)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)
