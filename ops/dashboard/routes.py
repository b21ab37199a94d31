"""The dashboard's HTTP routes, for an app that includes `router()`:

    GET  /ops/dashboard        the page (HTML); without a valid ops token or session, the login form
    GET  /ops/dashboard.json   the numbers
    GET  /ops/dashboard/app.js plotly.js and the code that draws the charts
    POST /ops/login            an ops token (form) for a session cookie
    POST /ops/logout           forget the session

Authentication is the app's ops token (feedback.core.auth, `app.state.tokens`). A browser
cannot add a bearer header to a page load, so `POST /ops/login` (a form) sets an HttpOnly,
SameSite=Strict cookie instead. The cookie holds an HMAC of the token, not the token: it opens
the dashboard and nothing else, and stops working when the token is removed from
serve.ops_tokens. Tokens never go in URLs. The database is `app.state.database_url`.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from typing import Annotated
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from feedback import db
from feedback.core.auth import matches, require_ops, tokens
from feedback.core.errors import first_line
from ops.dashboard.data import dashboard_data
from ops.dashboard.page import app_js, login_html, render_html

COOKIE = "flywheel_ops"
SESSION_MAX_AGE_S = 12 * 3600
REFRESH_S = 60
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


def session_value(token: str) -> str:
    """What the cookie holds for `token`: a keyed hash that opens the dashboard and nothing else."""
    return hmac.new(token.encode(), b"flywheel ops dashboard session", hashlib.sha256).hexdigest()


def require_ops_session(request: Request) -> str:
    """feedback.core.auth.require_ops (bearer header: 401 / 403 / ok), or else the session cookie
    set by `POST /ops/login`."""
    cookie = request.cookies.get(COOKIE)
    if request.headers.get("authorization") or not cookie:
        return require_ops(request)
    for token in tokens(request).ops:
        if matches(cookie, (session_value(token),)):
            return token
    raise HTTPException(401, "the dashboard session is no longer valid (was the ops token removed?): log in again")


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
    api.post("/login", response_class=HTMLResponse, responses={303: {}, 401: {}, 403: {}})(login)
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
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    token = (form.get("token") or [""])[0].strip()
    allowed = tokens(request)
    if token and matches(token, allowed.ops):
        resp = RedirectResponse("dashboard", status_code=303)
        resp.set_cookie(
            COOKIE,
            session_value(token),
            max_age=SESSION_MAX_AGE_S,
            path="/ops",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return resp
    if token and matches(token, allowed.editor):
        return _login_page(403, "that is an editor token; the dashboard needs an ops token (serve.ops_tokens)")
    return _login_page(401, "wrong token" if token else "enter an ops token")


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


def _login_page(status: int, message: str) -> HTMLResponse:
    headers = PAGE_HEADERS | ({"WWW-Authenticate": 'Bearer realm="flywheel ops"'} if status == 401 else {})
    return HTMLResponse(login_html(status, message), status_code=status, headers=headers)
