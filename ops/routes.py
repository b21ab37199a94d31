"""The route groups the served API has besides serving's own: the ops dashboard and the rollout
routes, as router factories (plain importable functions, which Ray pickles by reference) for
`serving.app.start(routers=...)` and `serving.http.app.build_app(routers=...)`.

Serving never imports these: whoever builds the app passes them in (`flywheel serve`, the demo,
the benchmarks, the tests), so the services stay independent of each other.
"""

from __future__ import annotations


def ops_routers() -> tuple:
    """The dashboard's and the rollout controller's router factories."""
    from ops.dashboard.routes import router as dashboard_router
    from ops.rollout.routes import router as rollout_router

    return (dashboard_router, rollout_router)
