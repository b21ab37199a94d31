"""`build_app(routers)`: the FastAPI app of serving's routes, plus the route groups passed in.

Serving's own routes (completions, llama.cpp's /infill, Ollama's /api, events,
health/models/metrics) are always there; other route groups (the ops dashboard and rollout
routes) are added by whoever builds the app: `flywheel serve` through serving/app.py's
ingress, the demo, benchmarks and tests. Every
error answers `{"error": {"message", "type"}}` (OpenAI's shape), and every request is
counted and timed by route in Prometheus, and says where its time went in a `Server-Timing`
header (serving/http/timing.py). A body larger than serve.limits.max_body_bytes
gets 413 on every route, before it is parsed (feedback/core/web.py).

The app's `state` is an `AppState`: routes read its `api` (an ApiState), the token checks
its `tokens`, the ops routes its `database_url`, every route group its `limits` and the
dashboard its `dashboard` settings.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from feedback.core.web import BodyLimit, http_limits
from serving.http import completions, events, info, llamacpp, ollama
from serving.http.deps import AppState
from serving.http.timing import RequestTiming


def build_app(routers: Iterable[APIRouter] = ()) -> FastAPI:
    """Serving's routes, then `routers` in order. Set `app.state.api` before the first request."""
    app = FastAPI(
        title="Flywheel",
        version="0.1.0",
        description="Code completion that learns from its users. OpenAI-, Tabby-, llama.cpp- and Ollama-compatible.",
    )
    app.state = AppState()
    # Inside the request timing below, so a refused body is counted too.
    app.add_middleware(BodyLimit, limit=lambda scope: http_limits(app.state).max_body_bytes)
    app.add_middleware(RequestTiming)  # added last: the outermost, so its clock starts first

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
        where = ".".join(str(x) for x in _field_path(first.get("loc", ())))
        message = f"{where}: {first['msg']}" if where else first["msg"]
        # Not the rejected inputs: they may be what cannot be encoded (NaN, a lone surrogate), and
        # a client has them already.
        details = [{k: v for k, v in e.items() if k != "input"} for e in errors]
        return ErrorResponse(
            status_code=422,
            content={
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "details": json.loads(json.dumps(details, default=str)),
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
        return ErrorResponse(
            status_code=exc.status_code,
            content={"error": {"message": exc.detail, "type": kind}},
            headers=getattr(exc, "headers", None),
        )

    for r in (completions.router, llamacpp.router, ollama.router, events.router, info.router, *routers):
        app.include_router(r)
    return app


def _field_path(loc) -> list:
    """A validation error's location as the client wrote it: without FastAPI's leading "body" and
    the completion shape's tag ("openai" / "tabby"), so `segments.declarations.0.body` stays whole."""
    loc = list(loc)
    if loc[:1] == ["body"]:
        loc = loc[1:]
        if loc[:1] in (["openai"], ["tabby"]):
            loc = loc[1:]
    return loc


class ErrorResponse(JSONResponse):
    """An error body in ASCII JSON: a message that quotes a client's text always encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")
