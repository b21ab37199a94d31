"""The ops dashboard: how each model version does, the rollout, deltas, swaps, feedback volume.

data.py     dashboard_data(engine) -> dict: the numbers, read with SQL that runs on SQLite
            and PostgreSQL
page.py     render_html(data) -> str: one page of plotly charts and tables (pure), the login form
routes.py   router(): GET /ops/dashboard (HTML), GET /ops/dashboard.json, POST /ops/login and
            /ops/logout, for the app `flywheel serve` builds (serving.http.app.build_app)
write_static(engine, path)   both data and page, to a file (`flywheel dashboard --out PATH`)
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.engine import Engine

from ops.dashboard.data import dashboard_data
from ops.dashboard.page import render_html


def write_static(engine: Engine, path: str | Path) -> Path:
    """Write a self-contained copy of the dashboard (plotly.js inlined) to `path`."""
    page = render_html(dashboard_data(engine))
    out = Path(path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)  # a reader never sees half a page
    return out
