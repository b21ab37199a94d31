"""The HTTP API, one module per route group, assembled by `app.build_app(routers=...)`.

deps.py         ApiState (what the routes serve from) and `StateDep`; tokens: feedback.core.auth
routing.py      RoutingState: which pool a user goes to; the poll that keeps it current
completions.py  POST /v1/completions (OpenAI and Tabby shapes, SSE streaming)
events.py       POST /v1/events
info.py         GET /v1/health, /v1/models, /metrics
app.py          build_app(routers): serving's routes, error bodies, request metrics, and
                the route groups the caller passes in (`flywheel serve` adds the ops routes)
timing.py       where a request's time goes: Server-Timing stages, request metrics
"""
