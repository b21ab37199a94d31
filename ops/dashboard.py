"""The ops dashboard: how each model version does, the rollout, deltas, swaps, feedback volume.

    dashboard_data(engine) -> dict   the numbers, read with SQL that runs on SQLite and PostgreSQL
    render_html(data) -> str         one page of plotly charts and tables; pure, and self-contained
                                     unless `script_src` points at the served script
    write_static(engine, path)       both, to a file (`flywheel dashboard --out PATH`)
    router()                         GET /ops/dashboard (HTML), GET /ops/dashboard.json,
                                     POST /ops/login and /ops/logout, for the app `flywheel serve`
                                     builds (serving.http.app.build_app)

The charts are plotly.js, bundled in the `plotly` Python package, so the page needs no CDN:
the served page loads it from `/ops/dashboard/app.js` (cached), the static copy inlines it.

Authentication is the app's ops token (feedback.core.auth, `app.state.tokens`). A browser
cannot add a bearer header to a page load, so `POST /ops/login` (a form) sets an HttpOnly,
SameSite=Strict cookie instead. The cookie holds an HMAC of the token, not the token: it opens
the dashboard and nothing else, and stops working when the token is removed from
serve.ops_tokens. Tokens never go in URLs. The database is `app.state.database_url`.

Time series are bucketed in SQL by whole seconds since the epoch; the bucket grows with the
span of the data (a minute for a short demo, a day for months) so a chart has at most
~`MAX_BUCKETS` points.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import json
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from sqlalchemy import case, desc, func, select, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from feedback import db
from feedback.core.auth import matches, require_ops, tokens
from feedback.core.clock import as_utc
from feedback.core.errors import first_line

MAX_BUCKETS = 96
NICE_BUCKETS_S = (60, 300, 900, 3600, 6 * 3600, 86400, 7 * 86400)
MAX_SWAPS = 500  # the most recent swap events plotted
RECENT_ROLLOUTS = 10


# --- data ----------------------------------------------------------------------------------------


def dashboard_data(engine: Engine, *, bucket_s: int | None = None) -> dict[str, Any]:
    """Everything the page shows, as JSON-ready data (timestamps are ISO 8601 strings in UTC)."""
    with engine.connect() as conn:
        c = db.completions.c
        first, last = conn.execute(select(func.min(c.created_at), func.max(c.created_at))).one()
        bucket_s = bucket_s or pick_bucket(first, last)
        dialect = conn.dialect.name
        bucket = lambda column: _bucket_sql(dialect, column, bucket_s)  # noqa: E731
        swaps = _swaps(conn)
        return {
            "generated_at": _iso(datetime.now(UTC)),
            "bucket_s": bucket_s,
            "span": {"first": _iso(first), "last": _iso(last)},
            "totals": _totals(conn),
            "pools": _pools(conn),
            "versions": _versions(conn),
            "acceptance": _acceptance(conn, bucket),
            "reward": _reward(conn, bucket),
            "volume": _volume(conn, bucket),
            "rollout": _current_rollout(conn),
            "rollouts": _recent_rollouts(conn),
            "swaps": swaps,
            "swap_summary": summarise_swaps(swaps),
        }


def pick_bucket(first: datetime | None, last: datetime | None) -> int:
    """The smallest nice bucket (seconds) that keeps the span within MAX_BUCKETS points."""
    if first is None or last is None:
        return NICE_BUCKETS_S[0]
    span = (as_utc(last) - as_utc(first)).total_seconds()
    return next((b for b in NICE_BUCKETS_S if span / b <= MAX_BUCKETS), NICE_BUCKETS_S[-1])


def _bucket_sql(dialect: str, column: str, bucket_s: int) -> str:
    """SQL for the start of `column`'s bucket, in whole seconds since the epoch (UTC)."""
    assert isinstance(bucket_s, int) and bucket_s > 0  # inlined into SQL
    if dialect == "postgresql":
        return f"CAST(FLOOR(EXTRACT(EPOCH FROM {column}) / {bucket_s}) AS BIGINT) * {bucket_s}"
    # SQLite keeps timestamps as UTC text; integer division floors for positive numbers
    return f"(CAST(strftime('%s', {column}) AS INTEGER) / {bucket_s}) * {bucket_s}"


def _totals(conn: Connection) -> dict[str, int]:
    count = lambda t: conn.execute(select(func.count()).select_from(t)).scalar_one()  # noqa: E731
    return {
        "completions": count(db.completions),
        "events": count(db.events),
        "rewards": count(db.rewards),
        "versions": count(db.model_versions),
        "swaps": count(db.swap_events),
    }


def _pools(conn: Connection) -> list[dict]:
    p = db.serving_pools.c
    rows = conn.execute(
        select(p.pool, p.version, p.traffic_percent, p.rollout_id, p.updated_at).order_by(p.pool)
    ).mappings()
    return [_plain_row(r) for r in rows]


def _versions(conn: Connection) -> list[dict]:
    """One row per version seen anywhere: registry facts (sizes, gate) and served feedback."""
    mv = db.model_versions.c
    registry = {
        r["version"]: _plain_row(r)
        for r in conn.execute(
            select(
                mv.version,
                mv.parent,
                mv.kind,
                mv.size_bytes,
                mv.full_size_bytes,
                mv.gate_passed,
                mv.gate_reason,
                mv.created_at,
            )
        ).mappings()
    }
    served = {
        r.model_version: r
        for r in conn.execute(
            text(
                "SELECT model_version, COUNT(DISTINCT completion_id) AS completions, SUM(shown) AS shown, SUM(accepted) AS accepted "
                "FROM v_choice_feedback GROUP BY model_version"
            )
        )
    }
    rewarded = {
        r.model_version: r
        for r in conn.execute(text("SELECT model_version, rewarded, mean_reward FROM v_version_rewards"))
    }
    out = []
    for v in sorted(set(registry) | set(served) | set(rewarded)):
        row = registry.get(v) or {
            "version": v,
            "parent": None,
            "kind": None,
            "size_bytes": None,
            "full_size_bytes": None,
            "gate_passed": None,
            "gate_reason": None,
            "created_at": None,
        }
        s, r = served.get(v), rewarded.get(v)
        shown, accepted = int(s.shown or 0) if s else 0, int(s.accepted or 0) if s else 0
        out.append(
            row
            | {
                "completions": int(s.completions) if s else 0,
                "shown": shown,
                "accepted": accepted,
                "accept_rate": accepted / shown if shown else None,
                "rewarded": int(r.rewarded) if r else 0,
                "mean_reward": float(r.mean_reward) if r and r.mean_reward is not None else None,
            }
        )
    return out


def _acceptance(conn: Connection, bucket) -> list[dict]:
    """Accept rate per version and time bucket: accepted choices over shown choices."""
    rows = conn.execute(
        text(f"""
        SELECT ts, model_version, SUM(shown) AS shown, SUM(accepted) AS accepted
        FROM (SELECT {bucket("created_at")} AS ts, model_version, shown, accepted FROM v_choice_feedback) b
        GROUP BY ts, model_version ORDER BY ts, model_version
    """)
    )
    return [
        {
            "t": _iso_epoch(r.ts),
            "version": r.model_version,
            "shown": int(r.shown),
            "accepted": int(r.accepted),
            "accept_rate": int(r.accepted) / int(r.shown) if r.shown else None,
        }
        for r in rows
    ]


def _reward(conn: Connection, bucket) -> list[dict]:
    """Mean reward per version, bucketed by when the rewarded completion was served."""
    rows = conn.execute(
        text(f"""
        SELECT ts, model_version, COUNT(*) AS rewarded, AVG(reward) AS mean_reward
        FROM (SELECT {bucket("c.created_at")} AS ts, r.model_version, r.reward
              FROM rewards r JOIN completions c ON c.completion_id = r.completion_id) b
        GROUP BY ts, model_version ORDER BY ts, model_version
    """)
    )
    return [
        {
            "t": _iso_epoch(r.ts),
            "version": r.model_version,
            "rewarded": int(r.rewarded),
            "mean_reward": float(r.mean_reward),
        }
        for r in rows
    ]


def _volume(conn: Connection, bucket) -> dict[str, list[dict]]:
    completions = conn.execute(
        text(f"""
        SELECT ts, COUNT(*) AS n FROM (SELECT {bucket("created_at")} AS ts FROM completions) b GROUP BY ts ORDER BY ts
    """)
    )
    events = conn.execute(
        text(f"""
        SELECT ts, type, COUNT(*) AS n FROM (SELECT {bucket("created_at")} AS ts, type FROM events) b
        GROUP BY ts, type ORDER BY ts, type
    """)
    )
    return {
        "completions": [{"t": _iso_epoch(r.ts), "n": int(r.n)} for r in completions],
        "events": [{"t": _iso_epoch(r.ts), "type": r.type, "n": int(r.n)} for r in events],
    }


def _current_rollout(conn: Connection) -> dict | None:
    """The running (or paused) rollout, else the latest one, with every step decided so far."""
    ro, st = db.rollouts.c, db.rollout_steps.c
    active = case((ro.state.in_(("running", "paused")), 0), else_=1)
    row = conn.execute(select(db.rollouts).order_by(active, desc(ro.id)).limit(1)).mappings().first()
    if row is None:
        return None
    steps = conn.execute(
        select(st.step_index, st.weight, st.decision, st.evidence, st.decided_at)
        .where(st.rollout_id == row["id"])
        .order_by(st.decided_at, st.id)
    ).mappings()
    return _plain_row(row) | {"active": row["state"] in ("running", "paused"), "steps": [_plain_row(s) for s in steps]}


def _recent_rollouts(conn: Connection) -> list[dict]:
    ro = db.rollouts.c
    cols = (
        ro.id,
        ro.candidate_version,
        ro.stable_version,
        ro.state,
        ro.step_index,
        ro.reason,
        ro.started_at,
        ro.finished_at,
    )
    return [_plain_row(r) for r in conn.execute(select(*cols).order_by(desc(ro.id)).limit(RECENT_ROLLOUTS)).mappings()]


def _swaps(conn: Connection) -> list[dict]:
    sw = db.swap_events.c
    cols = (
        sw.at,
        sw.pool,
        sw.replica,
        sw.from_version,
        sw.to_version,
        sw.ok,
        sw.pause_s,
        sw.prepare_s,
        sw.tensors_reloaded,
        sw.fetched_bytes,
        sw.error,
    )
    rows = conn.execute(select(*cols).order_by(desc(sw.at), desc(sw.id)).limit(MAX_SWAPS)).mappings()
    return [_plain_row(r) for r in reversed(list(rows))]


def summarise_swaps(swaps: list[dict]) -> list[dict]:
    """Per target version: swaps, failures, median and worst pause of the successful ones."""
    out = []
    for v in sorted({s["to_version"] for s in swaps}):
        mine = [s for s in swaps if s["to_version"] == v]
        pauses = sorted(s["pause_s"] for s in mine if s["ok"])
        out.append(
            {
                "to_version": v,
                "swaps": len(mine),
                "failed": sum(not s["ok"] for s in mine),
                "p50_pause_s": pauses[(len(pauses) - 1) // 2] if pauses else None,  # nearest rank, as the SQL views
                "max_pause_s": pauses[-1] if pauses else None,
            }
        )
    return out


def _iso(t: datetime | None) -> str | None:
    return None if t is None else as_utc(t).isoformat()


def _iso_epoch(seconds: Any) -> str:
    return datetime.fromtimestamp(int(seconds), UTC).isoformat()


def _plain_row(row) -> dict:
    return {k: _iso(v) if isinstance(v, datetime) else v for k, v in dict(row).items()}


# --- the page ------------------------------------------------------------------------------------

# Runs after the page's markup: draws every figure from the JSON block. Served as part of app.js.
BOOT_JS = """
(function () {
  var figures = JSON.parse(document.getElementById('figures').textContent);
  figures.forEach(function (f) {
    Plotly.newPlot(f.id, f.figure.data, f.figure.layout, {displaylogo: false, responsive: true});
  });
})();
"""

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; background: #f5f6f8; color: #1d2330; }
header { background: #1d2330; color: #fff; padding: 12px 24px; display: flex; gap: 24px; align-items: baseline; }
header h1 { font-size: 18px; margin: 0; } header .meta { color: #b8c0d0; font-size: 12px; }
main { padding: 16px 24px; display: grid; grid-template-columns: repeat(auto-fit, minmax(560px, 1fr)); gap: 16px; }
section { background: #fff; border-radius: 6px; padding: 12px 16px; box-shadow: 0 1px 2px rgba(0,0,0,.08); min-width: 0; }
section.wide { grid-column: 1 / -1; }
h2 { font-size: 15px; margin: 0 0 8px; } table + h2 { margin-top: 16px; }
.kpis { display: flex; gap: 12px; flex-wrap: wrap; }
.kpi { background: #f0f2f6; border-radius: 4px; padding: 6px 12px; } .kpi b { display: block; font-size: 18px; }
.chart { height: 320px; } #chart-rollout { height: 260px; } .empty { color: #7a8294; font-style: italic; padding: 24px 0; }
table { border-collapse: collapse; width: 100%; font-size: 13px; margin-top: 8px; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #e4e7ee; vertical-align: top; }
th { color: #5a6275; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.state { font-weight: 600; } .bad { color: #b3261e; } .good { color: #1e7b34; }
.evidence { font-family: ui-monospace, monospace; font-size: 12px; color: #3d4455; }
"""

PALETTE = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880")


def render_html(data: dict[str, Any], *, script_src: str | None = None, refresh_s: int | None = None) -> str:
    """The dashboard page for `dashboard_data`'s output. With `script_src` None, plotly.js is
    inlined (a static, offline copy of ~5 MB); otherwise the page loads that script (`app_js()`)."""
    figures: list[tuple[str, Any]] = []
    sections = [
        _overview(data),
        _section("Accept rate by version", _chart("accept", _accept_figure(data), figures)),
        _section("Mean reward by version", _chart("reward", _reward_figure(data), figures)),
        _section("Rollout", _rollout_html(data, figures), wide=True),
        _section(
            "Versions: delta vs full snapshot",
            _chart("sizes", _sizes_figure(data), figures) + _versions_table(data),
            wide=True,
        ),
        _section("Hot-swap pauses", _chart("swaps", _swaps_figure(data), figures) + _swap_table(data)),
        _section("Feedback volume", _chart("volume", _volume_figure(data), figures)),
    ]
    payload = "[" + ",".join(f'{{"id":{json.dumps(i)},"figure":{_figure_json(f)}}}' for i, f in figures) + "]"
    script = f'<script src="{html.escape(script_src)}"></script>' if script_src else f"<script>{app_js()}</script>"
    refresh = f'<meta http-equiv="refresh" content="{int(refresh_s)}">' if refresh_s else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
{refresh}<title>Flywheel ops dashboard</title><style>{CSS}</style></head>
<body><header><h1>Flywheel ops dashboard</h1>
<span class="meta">generated {_e(_short(data["generated_at"]))} UTC &middot; time buckets of {_e(_duration(data["bucket_s"]))}</span></header>
<main>{"".join(sections)}</main>
<script type="application/json" id="figures">{payload}</script>
{script}
</body></html>
"""


def app_js() -> str:
    """plotly.js (from the `plotly` package, no CDN) followed by the code that draws the figures."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs() + "\n" + BOOT_JS


def _figure_json(fig) -> str:
    import plotly.io as pio

    # plotly escapes '<' and '/' already; escaping again keeps the </script> guarantee ours
    return pio.to_json(fig, validate=False).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _chart(name: str, fig, figures: list) -> str:
    if fig is None:
        return '<div class="empty">no data yet</div>'
    figures.append((f"chart-{name}", fig))
    return f'<div class="chart" id="chart-{name}"></div>'


def _section(title: str, body: str, *, wide: bool = False) -> str:
    attrs = ' class="wide"' if wide else ""
    return f"<section{attrs}><h2>{_e(title)}</h2>{body}</section>"


def _layout(**kw) -> dict:
    base = dict(
        template="plotly_white",
        margin=dict(l=50, r=20, t=10, b=40),
        legend=dict(orientation="h", y=-0.18),
        hovermode="closest",
    )
    return base | kw


def _by_version(rows: list[dict], y: str) -> dict[int, tuple[list, list, list]]:
    out: dict[int, tuple[list, list, list]] = {}
    for r in rows:
        xs, ys, rs = out.setdefault(r["version"], ([], [], []))
        xs.append(_short(r["t"]))
        ys.append(r[y])
        rs.append(r)
    return out


def _color(version: int, versions: list[int]) -> str:
    return PALETTE[versions.index(version) % len(PALETTE)] if version in versions else PALETTE[0]


def _accept_figure(data: dict):
    import plotly.graph_objects as go

    series = _by_version(data["acceptance"], "accept_rate")
    if not series:
        return None
    versions = [v["version"] for v in data["versions"]]
    fig = go.Figure(layout=_layout(yaxis=dict(tickformat=".0%", rangemode="tozero", title="accepted / shown")))
    for v, (xs, ys, rows) in series.items():
        fig.add_scatter(
            x=xs,
            y=ys,
            name=f"v{v}",
            mode="lines+markers",
            line=dict(color=_color(v, versions)),
            customdata=[[r["accepted"], r["shown"]] for r in rows],
            hovertemplate=f"v{v}<br>%{{x}}<br>%{{y:.1%}} (%{{customdata[0]}} of %{{customdata[1]}})<extra></extra>",
        )
    return fig


def _reward_figure(data: dict):
    import plotly.graph_objects as go

    series = _by_version(data["reward"], "mean_reward")
    if not series:
        return None
    versions = [v["version"] for v in data["versions"]]
    fig = go.Figure(layout=_layout(yaxis=dict(title="mean reward", zeroline=True)))
    for v, (xs, ys, rows) in series.items():
        fig.add_scatter(
            x=xs,
            y=ys,
            name=f"v{v}",
            mode="lines+markers",
            line=dict(color=_color(v, versions)),
            customdata=[r["rewarded"] for r in rows],
            hovertemplate=f"v{v}<br>%{{x}}<br>%{{y:.3f}} over %{{customdata}} choices<extra></extra>",
        )
    return fig


def _sizes_figure(data: dict):
    import plotly.graph_objects as go

    rows = [v for v in data["versions"] if v["size_bytes"] is not None]
    if not rows:
        return None
    names = [f"v{v['version']}" for v in rows]
    ratio = [f"{v['size_bytes'] / v['full_size_bytes']:.1%}" if v["full_size_bytes"] else "" for v in rows]
    fig = go.Figure(layout=_layout(barmode="group", yaxis=dict(title="MB"), xaxis=dict(type="category")))
    fig.add_bar(
        x=names,
        y=[v["size_bytes"] / 1e6 for v in rows],
        name="delta shipped",
        text=ratio,
        textposition="outside",
        hovertemplate="%{x}: %{y:.2f} MB delta (%{text} of full)<extra></extra>",
    )
    fig.add_bar(
        x=names,
        y=[v["full_size_bytes"] / 1e6 for v in rows],
        name="full snapshot",
        hovertemplate="%{x}: %{y:.2f} MB full<extra></extra>",
    )
    return fig


def _swaps_figure(data: dict):
    import plotly.graph_objects as go

    swaps = data["swaps"]
    if not swaps:
        return None
    fig = go.Figure(layout=_layout(yaxis=dict(title="pause (ms)", rangemode="tozero")))
    for pool in sorted({s["pool"] for s in swaps}):
        mine = [s for s in swaps if s["pool"] == pool]
        fig.add_scatter(
            x=[_short(s["at"]) for s in mine],
            y=[s["pause_s"] * 1000 for s in mine],
            name=pool,
            mode="markers",
            marker=dict(size=9, symbol=["circle" if s["ok"] else "x" for s in mine]),
            customdata=[
                [s["replica"], s["from_version"], s["to_version"], "ok" if s["ok"] else "FAILED"] for s in mine
            ],
            hovertemplate="%{customdata[0]}: v%{customdata[1]} → v%{customdata[2]} %{customdata[3]}<br>pause %{y:.1f} ms<extra></extra>",
        )
    return fig


def _volume_figure(data: dict):
    import plotly.graph_objects as go

    vol = data["volume"]
    if not vol["completions"] and not vol["events"]:
        return None
    fig = go.Figure(layout=_layout(barmode="stack", yaxis=dict(title=f"per {_duration(data['bucket_s'])}")))
    for kind in sorted({e["type"] for e in vol["events"]}):
        mine = [e for e in vol["events"] if e["type"] == kind]
        fig.add_bar(x=[_short(e["t"]) for e in mine], y=[e["n"] for e in mine], name=f"{kind} events", opacity=0.8)
    fig.add_scatter(
        x=[_short(c["t"]) for c in vol["completions"]],
        y=[c["n"] for c in vol["completions"]],
        name="completions",
        mode="lines+markers",
        line=dict(color="#1d2330", width=2),
    )
    return fig


def _rollout_figure(ro: dict):
    """The planned canary share per step (dashed) and each decision taken, at its step."""
    import plotly.graph_objects as go

    weights, steps = ro["weights"] or [], ro["steps"]
    if not weights and not steps:
        return None
    fig = go.Figure(
        layout=_layout(yaxis=dict(title="canary traffic %", range=[0, 115]), xaxis=dict(title="step", dtick=1))
    )
    fig.add_scatter(
        x=list(range(1, len(weights) + 1)),
        y=weights,
        name="plan",
        mode="lines+markers",
        line=dict(dash="dot", color="#9aa3b5", shape="hv"),
        hovertemplate="step %{x}: %{y}%<extra>plan</extra>",
    )
    fig.add_scatter(
        x=[s["step_index"] + 1 for s in steps],
        y=[s["weight"] for s in steps],
        name="decisions",
        mode="markers+text",
        marker=dict(size=12, color=[_DECISION_COLORS.get(s["decision"], "#636efa") for s in steps]),
        text=[s["decision"] for s in steps],
        textposition="top center",
        hovertemplate="step %{x} at %{y}%: %{text}<extra></extra>",
    )
    return fig


_DECISION_COLORS = {
    "advance": "#00a36c",
    "promote": "#1e7b34",
    "hold": "#ffa15a",
    "pause": "#ffa15a",
    "rollback": "#b3261e",
    "abort": "#b3261e",
}


def _overview(data: dict) -> str:
    t = data["totals"]
    kpis = [
        ("completions", t["completions"]),
        ("events", t["events"]),
        ("rewards", t["rewards"]),
        ("model versions", t["versions"]),
    ]
    kpis += [
        (f"{p['pool']} pool", f"v{p['version']} · {p['traffic_percent']:g}%" if p["version"] is not None else "idle")
        for p in data["pools"]
    ]
    ro = data["rollout"]
    if ro is not None and ro["active"]:
        kpis.append(
            ("rollout", f"v{ro['candidate_version']} {ro['state']}, step {ro['step_index'] + 1}/{len(ro['weights'])}")
        )
    cards = "".join(f'<div class="kpi"><span>{_e(k)}</span><b>{_e(v)}</b></div>' for k, v in kpis)
    return _section("Overview", f'<div class="kpis" id="overview">{cards}</div>', wide=True)


def _rollout_html(data: dict, figures: list) -> str:
    ro = data["rollout"]
    if ro is None:
        return '<div class="empty">no rollout yet</div>'
    weights = ro["weights"] or []
    n = len(weights)
    now = f"step {ro['step_index'] + 1} of {n}" if n else f"step {ro['step_index'] + 1}"
    at = f" ({weights[ro['step_index']]:g}% of traffic)" if 0 <= ro["step_index"] < n else ""
    state_css = {"rolled_back": "bad", "aborted": "bad", "promoted": "good"}.get(ro["state"], "")
    head = (
        f'<p id="rollout-summary">Rollout #{ro["id"]}: candidate <b>v{ro["candidate_version"]}</b> against stable '
        f'<b>v{ro["stable_version"]}</b> &middot; <span class="state {state_css}">{_e(ro["state"])}</span> &middot; '
        f"<b>{_e(now)}</b>{_e(at)} &middot; steps {_e(' → '.join(f'{w:g}%' for w in weights))} "
        f"&middot; every {_e(_duration(ro['interval_s']))}, at least {ro['min_samples']} samples"
        + (f" &middot; {_e(ro['reason'])}" if ro.get("reason") else "")
        + "</p>"
    )
    rows = "".join(
        f'<tr><td class="num">{s["step_index"] + 1}</td><td class="num">{s["weight"]:g}%</td><td><b>{_e(s["decision"])}</b></td>'
        f'<td class="evidence">{_evidence_html(s["evidence"])}</td><td>{_e(_short(s["decided_at"]))}</td></tr>'
        for s in ro["steps"]
    )
    table = f'<table id="rollout-steps"><tr><th>step</th><th>canary</th><th>decision</th><th>evidence</th><th>decided (UTC)</th></tr>{rows}</table>'
    if not ro["steps"]:
        table = '<div class="empty">no decision yet</div>'
    thresholds = (
        f'<p class="evidence">thresholds: {_evidence_html(ro["thresholds"])}</p>' if ro.get("thresholds") else ""
    )
    chart = _chart("rollout", _rollout_figure(ro), figures)
    return head + thresholds + chart + table + _rollout_history(data)


def _rollout_history(data: dict) -> str:
    past = [r for r in data["rollouts"] if r["id"] != (data["rollout"] or {}).get("id")]
    if not past:
        return ""
    rows = "".join(
        f'<tr><td class="num">#{r["id"]}</td><td>v{r["candidate_version"]} vs v{r["stable_version"]}</td><td>{_e(r["state"])}</td>'
        f"<td>{_e(r['reason'] or '')}</td><td>{_e(_short(r['started_at']))}</td></tr>"
        for r in past
    )
    return f"<h2>Earlier rollouts</h2><table><tr><th>id</th><th>versions</th><th>state</th><th>reason</th><th>started (UTC)</th></tr>{rows}</table>"


def _evidence_html(evidence: Any) -> str:
    """Nested evidence as `key.sub = value` pairs, numbers shortened."""
    pairs: list[tuple[str, Any]] = []

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, sub in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), sub)
        else:
            pairs.append((prefix or "value", v))

    walk("", evidence)
    shown = pairs[:24]
    out = "; ".join(f"{_e(k)} = {_e(_fmt(v))}" for k, v in shown)
    return out + (f"; … {len(pairs) - len(shown)} more" if len(pairs) > len(shown) else "")


def _versions_table(data: dict) -> str:
    def size(b):
        return "" if b is None else f"{b / 1e6:,.2f} MB"

    rows = []
    for v in data["versions"]:
        ratio = (
            f"{v['size_bytes'] / v['full_size_bytes']:.1%}"
            if v["size_bytes"] is not None and v["full_size_bytes"]
            else ""
        )
        parent = "" if v["parent"] is None else f"v{v['parent']}"
        gate = (
            "" if v["gate_passed"] is None else ("passed" if v["gate_passed"] else f"failed: {v['gate_reason'] or ''}")
        )
        rows.append(
            f"<tr><td><b>v{v['version']}</b></td><td>{_e(v['kind'] or '')}</td><td>{parent}</td>"
            f'<td class="num">{size(v["size_bytes"])}</td><td class="num">{size(v["full_size_bytes"])}</td><td class="num">{ratio}</td>'
            f'<td>{_e(gate)}</td><td class="num">{v["completions"]:,}</td><td class="num">{v["shown"]:,}</td>'
            f'<td class="num">{_fmt_pct(v["accept_rate"])}</td><td class="num">{_fmt(v["mean_reward"])}</td></tr>'
        )
    head = (
        "<tr><th>version</th><th>kind</th><th>parent</th><th>delta</th><th>full</th><th>delta/full</th><th>gate</th>"
        "<th>completions</th><th>shown</th><th>accept rate</th><th>mean reward</th></tr>"
    )
    return f'<table id="versions">{head}{"".join(rows)}</table>'


def _swap_table(data: dict) -> str:
    if not data["swap_summary"]:
        return ""
    rows = "".join(
        f'<tr><td>v{s["to_version"]}</td><td class="num">{s["swaps"]}</td><td class="num {"bad" if s["failed"] else ""}">{s["failed"]}</td>'
        f'<td class="num">{_fmt_ms(s["p50_pause_s"])}</td><td class="num">{_fmt_ms(s["max_pause_s"])}</td></tr>'
        for s in data["swap_summary"]
    )
    return f'<table id="swaps"><tr><th>to</th><th>swaps</th><th>failed</th><th>median pause</th><th>worst pause</th></tr>{rows}</table>'


def _e(v: Any) -> str:
    return html.escape(str(v))


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def _fmt_pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.1%}"


def _fmt_ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.1f} ms"


def _short(iso: str | None) -> str:
    """'YYYY-MM-DD HH:MM:SS' (UTC), the date format plotly.js reads without time-zone guessing."""
    return "" if iso is None else iso[:19].replace("T", " ")


def _duration(seconds: float) -> str:
    for unit, n in (("week", 7 * 86400), ("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= n and seconds % n == 0:
            k = int(seconds // n)
            return f"{k} {unit}" + ("s" if k > 1 else "")
    return f"{seconds:g} s"


def write_static(engine: Engine, path: str | Path) -> Path:
    """Write a self-contained copy of the dashboard (plotly.js inlined) to `path`."""
    page = render_html(dashboard_data(engine))
    out = Path(path).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)  # a reader never sees half a page
    return out


# --- HTTP ----------------------------------------------------------------------------------------

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
    title = "Forbidden" if status == 403 else "Log in"
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Flywheel ops dashboard: {title}</title><style>{CSS}
main {{ display: block; max-width: 560px; }} form {{ display: flex; gap: 8px; margin-top: 12px; }} input[type=password] {{ flex: 1; padding: 6px; }}
</style></head>
<body><header><h1>Flywheel ops dashboard</h1></header>
<main><section><h2>{title}</h2><p id="message">{_e(message)}</p>
<form method="post" action="login"><input type="password" name="token" placeholder="ops token" autocomplete="current-password" required autofocus>
<button type="submit">Log in</button></form></section></main></body></html>
"""
    headers = PAGE_HEADERS | ({"WWW-Authenticate": 'Bearer realm="flywheel ops"'} if status == 401 else {})
    return HTMLResponse(page, status_code=status, headers=headers)
