"""The app builder: serving's routes plus the route groups passed in, the app state they read,
and the ingress building its app from router factories."""

import subprocess
import sys
from types import SimpleNamespace

from fastapi import APIRouter, Request
from fastapi.testclient import TestClient

from feedback.core.auth import OpsToken, Tokens
from serving.http.app import build_app
from serving.http.deps import ApiState
from serving.settings import ServeSettings

SERVING_PATHS = [
    "/v1/completions",
    "/infill",
    "/api/generate",
    "/api/tags",
    "/api/show",
    "/api/version",
    "/v1/events",
    "/v1/events/batch",
    "/v1/health",
    "/v1/models",
    "/metrics",
]


def extra_router() -> APIRouter:
    """A route group that is not serving's own, reading the app state as the ops routes do."""
    api = APIRouter(prefix="/extra")

    @api.get("")
    def extra(request: Request, token: OpsToken) -> dict:
        """What an ops route sees."""
        return {"token": token, "database_url": request.app.state.database_url}

    return api


def api_state(**kw) -> ApiState:
    return ApiState(
        cfg=ServeSettings(), replicas={}, producer=None, editor_tokens={"ed"}, decode=None, ops_tokens={"ops"}, **kw
    )


def paths(app) -> list[str]:
    return [r.path for r in app.routes if r.path not in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")]


def test_serving_routes_then_the_route_groups_passed_in():
    assert paths(build_app()) == SERVING_PATHS
    assert paths(build_app(routers=[extra_router()])) == [*SERVING_PATHS, "/extra"]


def test_tokens_and_database_follow_the_api_state():
    app = build_app(routers=[extra_router()])
    client = TestClient(app)
    r = client.get("/extra", headers={"Authorization": "Bearer ops"})
    assert r.status_code == 503 and r.json()["error"]["message"] == "the API is starting up"

    app.state.api = api_state(database_url="sqlite:///x.db")
    assert app.state.tokens == Tokens(editor=frozenset({"ed"}), ops=frozenset({"ops"}), allow_anonymous=False)
    r = client.get("/extra", headers={"Authorization": "Bearer ops"})
    assert r.status_code == 200 and r.json() == {"token": "ops", "database_url": "sqlite:///x.db"}
    r = client.get("/extra", headers={"Authorization": "Bearer ed"})
    assert r.status_code == 403 and "editor token" in r.json()["error"]["message"]

    app.state.api.ops_tokens = {"new"}  # a changed ApiState counts from the next request
    assert client.get("/extra", headers={"Authorization": "Bearer ops"}).status_code == 401
    assert client.get("/extra", headers={"Authorization": "Bearer new"}).status_code == 200

    app.state.tokens = Tokens(ops=frozenset({"own"}))  # set on its own, it wins
    assert client.get("/extra", headers={"Authorization": "Bearer own"}).status_code == 200
    assert client.get("/extra", headers={"Authorization": "Bearer new"}).status_code == 401


def test_the_ingress_builds_its_app_from_router_factories():
    from serving.app import Ingress

    st = api_state()
    replica = SimpleNamespace(routers=(extra_router,), state=st)  # what Ingress.__init__ leaves
    app = Ingress.func_or_class.__serve_build_asgi_app__(replica)
    assert app.state.api is st and paths(app) == [*SERVING_PATHS, "/extra"]
    r = TestClient(app).get("/extra", headers={"Authorization": "Bearer ops"})
    assert r.status_code == 200 and r.json()["token"] == "ops"


def test_serving_imports_no_ops_module():
    code = (
        "import sys, serving.app, serving.http.app, serving.http.completions, serving.http.events, serving.http.info, "
        "serving.http.llamacpp, serving.http.ollama; "
        "print(sorted(m for m in sys.modules if m == 'ops' or m.startswith('ops.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
