"""Bearer tokens on every HTTP route: the constant-time check, written once.

An app built from route modules (serving's completion API, the rollout and dashboard routes)
sets `app.state.tokens` to a `Tokens`; the dependencies below read it. Editor tokens open the
completion API; ops tokens open the ops routes. An editor token on an ops route is refused
with 403 (it authenticates, but may not act), anything else with 401.

Tokens are compared as UTF-8 bytes with `hmac.compare_digest`, so a token of any characters
is checked in constant time and never raises.

A browser cannot send a bearer header with a page load, so the dashboard trades an ops token
for a session cookie (ops/dashboard/routes.py); `DashboardLogin` holds its settings
(`[serve.dashboard]`), read from `app.state.dashboard` like the tokens.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import Depends, HTTPException, Request
from pydantic import Field

from feedback.core.config import Seconds, Section
from feedback.core.web import RateSpec


@dataclass(frozen=True)
class Tokens:
    editor: frozenset[str] = frozenset()
    ops: frozenset[str] = frozenset()
    allow_anonymous: bool = False
    """With no editor token configured, let editor routes through (local development only)."""
    users: Mapping[str, str] = field(default_factory=dict)
    """The user a named editor token belongs to (`token, user` in serve.auth_tokens_file)."""

    def holder(self, token: str) -> tuple[str, str]:
        """Who sends `token`, as a rate limit counts them: ("user", name) for a named token, so
        that all of one user's tokens share a limit, else ("token", token)."""
        name = self.users.get(token)
        return ("user", name) if name is not None else ("token", token)


class DashboardLogin(Section):
    """The ops dashboard's login (section `[serve.dashboard]`)."""

    session_max_age_s: Seconds = Field(default=12 * 3600, gt=0)
    """How long a dashboard session lasts: the cookie carries its signed start time, and the
    server refuses it after this long whatever the browser keeps (log in again)."""
    cookie_secure: Literal["auto", "always", "never"] = "auto"
    """Whether the session cookie is `Secure` (sent over https only). `auto`: always, except for a
    page the browser loads over plain http from a loopback address (127.0.0.1, localhost, ::1),
    so local use works without TLS. Behind a TLS proxy that passes the public Host on, `auto`
    is Secure; set `always` if the proxy rewrites Host to a loopback address."""
    login_failures: RateSpec = "5 per 15 minutes"
    """Failed logins from one client address (`limits` notation); beyond it every login from that
    address gets 429 with Retry-After until the window frees, a right token too, so guessing
    cannot go on. Behind a proxy all clients share its address: give the proxy its own limit."""


def dashboard_login(state: Any) -> DashboardLogin:
    """The app's dashboard login settings (`app.state.dashboard`), or the defaults."""
    return getattr(state, "dashboard", None) or DashboardLogin()


def matches(token: str, allowed: Iterable[str]) -> bool:
    """Whether `token` is one of `allowed`, in time independent of where they differ."""
    given = token.encode("utf-8", "surrogatepass")
    found = False
    for t in allowed:  # no early exit: the time does not depend on which token matched
        found |= hmac.compare_digest(given, t.encode("utf-8", "surrogatepass"))
    return found


def bearer(request: Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def tokens(request: Request) -> Tokens:
    t = getattr(request.app.state, "tokens", None)
    if t is None:
        raise HTTPException(503, "the API is starting up")
    return t


def require_editor(request: Request) -> str:
    """The caller's bearer token, if it is an editor token; 401 otherwise."""
    t = tokens(request)
    if not t.editor and t.allow_anonymous:
        return "anonymous"
    token = bearer(request)
    if token is None:
        raise HTTPException(
            401, "missing bearer token: send `Authorization: Bearer <token>`", headers={"WWW-Authenticate": "Bearer"}
        )
    if not matches(token, t.editor):
        raise HTTPException(401, "invalid token", headers={"WWW-Authenticate": "Bearer"})
    return token


def ops_check(t: Tokens, token: str | None) -> str:
    """`token` if it is an ops token; else the HTTPException an ops route answers with."""
    if token is None:
        raise HTTPException(
            401, "missing ops token: send `Authorization: Bearer <ops token>`", headers={"WWW-Authenticate": "Bearer"}
        )
    if matches(token, t.ops):
        return token
    if matches(token, t.editor):
        raise HTTPException(403, "an editor token cannot perform ops actions; use an ops token (serve.ops_tokens)")
    if not t.ops:
        raise HTTPException(403, "ops endpoints are disabled: no ops token is configured (serve.ops_tokens)")
    raise HTTPException(401, "invalid ops token", headers={"WWW-Authenticate": "Bearer"})


def require_ops(request: Request) -> str:
    """The caller's bearer token, if it is an ops token: 401 without a valid token, 403 for an
    editor token or when no ops token is configured."""
    return ops_check(tokens(request), bearer(request))


EditorToken = Annotated[str, Depends(require_editor)]
OpsToken = Annotated[str, Depends(require_ops)]
