"""What the serving routes read: the `ApiState`, and the app state other route groups read.

The Ray Serve ingress sets `app.state.api` on the app it builds in its replica
(serving/app.py); unit tests set it on the app they build. Tokens are checked by
feedback.core.auth, which reads `app.state.tokens`; route groups that are not serving's own
(the ops routes) read `app.state.database_url`, and every route group `app.state.limits` and
`app.state.dashboard` (serve.limits, serve.dashboard). On the serving app these follow its
ApiState (`AppState`), so changing the ApiState's tokens takes effect on the next request.

`CompletionsToken` and `EventsToken` are the editor token check plus its holder's rate limit
(serve.limits.completions, .events): 429 with Retry-After beyond it, counted in this ingress
replica's memory. A token the tokens file names (`token, user`) shares its limit with that
user's other tokens.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

from fastapi import Depends, HTTPException, Request
from starlette.datastructures import State

from feedback.core.auth import DashboardLogin, EditorToken, Tokens
from feedback.core.web import HttpLimits, http_limits, rate_limiter
from serving.http.routing import RoutingState
from serving.replica import GenerateRequest, GenerateResult
from serving.routing import caller_hash
from serving.settings import ServeSettings


class ReplicaClient(Protocol):
    """One replica pool, as the ingress sees it (serving.app.RayReplica over a deployment handle)."""

    async def complete(self, req: GenerateRequest) -> GenerateResult: ...

    def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResult]: ...

    async def served_version(self) -> int: ...


class RecordSink(Protocol):
    def send(self, topic: str, msg: Any) -> bool: ...


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
    prompt_format: dict = field(default_factory=dict)  # learner.formats.ModelFormat.describe() of the served model
    token_users: dict[str, str] = field(default_factory=dict)  # named editor tokens: token -> user

    def caller_hash(self, token: str, user: str | None) -> str:
        """The caller's `user_hash` (serving/routing.py): of the user a named token belongs to, else
        of the token and the request's `user`."""
        return caller_hash(self.cfg.user_hash_key(), token=token, user=user, token_users=self.token_users)

    @property
    def tokens(self) -> Tokens:
        """The editor and ops tokens, as feedback.core.auth checks them."""
        return Tokens(
            editor=frozenset(self.editor_tokens),
            ops=frozenset(self.ops_tokens),
            allow_anonymous=self.cfg.allow_anonymous,
            users=dict(self.token_users),
        )

    @property
    def limits(self) -> HttpLimits:
        return self.cfg.limits

    @property
    def dashboard(self) -> DashboardLogin:
        return self.cfg.dashboard


class AppState(State):
    """The serving app's `app.state`: `api` is its ApiState; the attributes in FOLLOW_API, unless
    set on their own, are the ApiState's (absent while it is not set, so the token checks
    answer 503 "the API is starting up")."""

    FOLLOW_API = ("tokens", "database_url", "limits", "dashboard")

    def __getattr__(self, key: str) -> Any:
        try:
            return super().__getattr__(key)
        except AttributeError:
            api = self._state.get("api")
            if api is None or key not in self.FOLLOW_API:
                raise
            return getattr(api, key)


def api_state(request: Request) -> ApiState:
    st = getattr(request.app.state, "api", None)
    if st is None:
        raise HTTPException(503, "the API is starting up")
    return st


StateDep = Annotated[ApiState, Depends(api_state)]


def _holder(request: Request, token: str) -> tuple[str, str]:
    t = getattr(request.app.state, "tokens", None)
    return t.holder(token) if t is not None else ("token", token)


def completions_quota(request: Request, token: EditorToken) -> str:
    """The editor token, within its completion rate limit (429 beyond it)."""
    rate_limiter(request.app.state).hit(
        http_limits(request.app.state).completions,
        "completions",
        *_holder(request, token),
        what="completion requests for this token",
    )
    return token


def events_quota(request: Request, token: EditorToken) -> str:
    """The editor token, within its event rate limit (429 beyond it)."""
    rate_limiter(request.app.state).hit(
        http_limits(request.app.state).events, "events", *_holder(request, token), what="events for this token"
    )
    return token


CompletionsToken = Annotated[str, Depends(completions_quota)]
EventsToken = Annotated[str, Depends(events_quota)]
