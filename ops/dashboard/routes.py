"""The dashboard's HTTP routes, for an app that includes `router()`:

    GET  /ops/dashboard        the page (HTML); without a valid ops token or session, the login form
    GET  /ops/dashboard.json   the numbers
    GET  /ops/dashboard/app.js plotly.js and the code that draws the charts
    POST /ops/login            an ops token (form) for a session cookie
    POST /ops/logout           forget the session

Authentication is the app's ops token (feedback.core.auth, `app.state.tokens`). A browser
cannot add a bearer header to a page load, so `POST /ops/login` (a form) sets an HttpOnly,
SameSite=Strict cookie instead. The cookie holds the login time signed with the token
(itsdangerous), not the token: it opens the dashboard and nothing else, the server refuses it
once serve.dashboard.session_max_age_s have passed, and it stops working when the token is
removed from serve.ops_tokens. It is `Secure` as serve.dashboard.cookie_secure says. Failed
logins are limited per client address (serve.dashboard.login_failures: 429 beyond).
Tokens never go in URLs. The database is `app.state.database_url`.
"""

from __future__ import annotations

import threading
from typing import Annotated
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from itsdangerous import BadSignature, TimestampSigner
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from feedback import db
from feedback.core.auth import DashboardLogin, dashboard_login, matches, require_ops, tokens
from feedback.core.errors import first_line
from feedback.core.web import rate_limiter
from ops.dashboard.data import dashboard_data
from ops.dashboard.page import app_js, login_html, render_html

COOKIE = "flywheel_ops"
REFRESH_S = 60
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# The served page runs only its own script (app.js); plotly adds inline styles as it draws.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; font-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


def signer(token: str) -> TimestampSigner:
    return TimestampSigner(token, salt="flywheel ops dashboard session")


def session_value(token: str) -> str:
    """What the cookie holds for `token`: the login time, signed with the token. It opens the
    dashboard and nothing else."""
    return signer(token).sign(b"ops").decode()


def session_token(cookie: str, ops_tokens, max_age_s: float) -> str | None:
    """The ops token that signed `cookie` within the last `max_age_s` seconds, else None."""
    for token in ops_tokens:
        try:
            signer(token).unsign(cookie, max_age=max_age_s)
            return token
        except BadSignature:  # also expired (SignatureExpired) and malformed values
            continue
    return None


def require_ops_session(request: Request) -> str:
    """feedback.core.auth.require_ops (bearer header: 401 / 403 / ok), or else the session cookie
    set by `POST /ops/login`."""
    cookie = request.cookies.get(COOKIE)
    if request.headers.get("authorization") or not cookie:
        return require_ops(request)
    token = session_token(cookie, tokens(request).ops, dashboard_login(request.app.state).session_max_age_s)
    if token is None:
        raise HTTPException(
            401, "the dashboard session has expired or is no longer valid (was the ops token removed?): log in again"
        )
    return token


OpsSession = Annotated[str, Depends(require_ops_session)]


def _engine(request: Request) -> Engine:
    url = getattr(request.app.state, "database_url", None)
    if not url:
        raise HTTPException(503, "the dashboard needs the database: this API was started without a database URL")
    return db.shared_engine(url)


def _data(request: Request) -> dict:
    try:
        return dashboard_data(_engine(request))
    except DBAPIError as e:
        raise HTTPException(
            503,
            f"the dashboard cannot read the database: {first_line(e, with_type=False)} (is it migrated? `flywheel db upgrade`)",
        ) from None


def router() -> APIRouter:
    """The dashboard's routes (under /ops)."""
    api = APIRouter(prefix="/ops", tags=["ops"])
    # Sync routes: FastAPI runs them in its thread pool, so the SQL never blocks the event loop.
    api.get("/dashboard", response_class=HTMLResponse, responses={401: {}, 403: {}, 503: {}})(dashboard)
    api.get("/dashboard.json", responses={401: {}, 403: {}, 503: {}})(dashboard_json)
    api.get("/dashboard/app.js", responses={401: {}, 403: {}})(dashboard_script)
    api.post("/login", response_class=HTMLResponse, responses={303: {}, 401: {}, 403: {}, 413: {}, 429: {}})(login)
    api.post("/logout", responses={303: {}})(logout)
    return api


def dashboard(request: Request) -> Response:
    """The ops dashboard (HTML); without a valid ops token or session, the login form."""
    try:
        require_ops_session(request)
    except HTTPException as e:
        if e.status_code not in (401, 403):
            raise
        fresh = not request.headers.get("authorization") and COOKIE not in request.cookies
        return _login_page(e.status_code, "Log in with an ops token (serve.ops_tokens)." if fresh else str(e.detail))
    page = render_html(_data(request), script_src="dashboard/app.js", refresh_s=REFRESH_S)
    return HTMLResponse(page, headers=PAGE_HEADERS)


def dashboard_json(request: Request, _token: OpsSession) -> JSONResponse:
    """The dashboard's numbers as JSON."""
    return JSONResponse(_data(request), headers={"Cache-Control": "no-store"})


def dashboard_script(_token: OpsSession) -> Response:
    """plotly.js and the code that draws the dashboard's charts."""
    return Response(_app_js_cached(), media_type="text/javascript", headers={"Cache-Control": "private, max-age=86400"})


async def login(request: Request) -> Response:
    """Exchange an ops token (form field `token`) for a dashboard session cookie."""
    settings = dashboard_login(request.app.state)
    limiter, address = rate_limiter(request.app.state), request.client.host if request.client else "unknown"
    what = "failed logins from this address"
    try:  # refused before the token is looked at, so guessing cannot go on behind the 429s
        limiter.check(settings.login_failures, "login", address, what=what)
    except HTTPException as e:
        return _login_page(e.status_code, str(e.detail), e.headers)
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    token = (form.get("token") or [""])[0].strip()
    allowed = tokens(request)
    if token and matches(token, allowed.ops):
        resp = RedirectResponse("dashboard", status_code=303)
        resp.set_cookie(
            COOKIE,
            session_value(token),
            max_age=int(settings.session_max_age_s),
            path="/ops",
            httponly=True,
            samesite="strict",
            secure=_secure(request, settings),
        )
        return resp
    if token:
        limiter.count(settings.login_failures, "login", address)
    if token and matches(token, allowed.editor):
        return _login_page(403, "that is an editor token; the dashboard needs an ops token (serve.ops_tokens)")
    return _login_page(401, "wrong token" if token else "enter an ops token")


def _secure(request: Request, settings: DashboardLogin) -> bool:
    """Whether the session cookie is Secure: serve.dashboard.cookie_secure, where `auto` leaves it
    off only for a page loaded over plain http from a loopback address."""
    if settings.cookie_secure != "auto":
        return settings.cookie_secure == "always"
    return request.url.scheme == "https" or request.url.hostname not in LOOPBACK


def logout() -> Response:
    """Forget the dashboard session."""
    resp = RedirectResponse("dashboard", status_code=303)
    resp.delete_cookie(COOKIE, path="/ops", httponly=True, samesite="strict")
    return resp


_js_lock = threading.Lock()
_js: str | None = None


def _app_js_cached() -> str:
    global _js
    with _js_lock:
        if _js is None:
            _js = app_js()
        return _js


def _login_page(status: int, message: str, headers: dict | None = None) -> HTMLResponse:
    headers = (
        PAGE_HEADERS | ({"WWW-Authenticate": 'Bearer realm="flywheel ops"'} if status == 401 else {}) | (headers or {})
    )
    return HTMLResponse(login_html(status, message), status_code=status, headers=headers)
