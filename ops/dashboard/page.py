"""The dashboard page: HTML, CSS and plotly figures for `data.dashboard_data`'s output.

    render_html(data) -> str         one page of plotly charts and tables; pure, and self-contained
                                     unless `script_src` points at the served script
    app_js() -> str                  plotly.js and the code that draws the figures
    login_html(status, message)      the login form the served page answers with

The charts are plotly.js, bundled in the `plotly` Python package, so the page needs no CDN:
the served page loads it from `/ops/dashboard/app.js` (cached), the static copy inlines it.
"""

from __future__ import annotations

import html
import json
from typing import Any

from feedback.db import INFERRED

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
        _section("Completion latency by version", _chart("latency", _latency_figure(data), figures)),
        _section("Error rate by version", _chart("errors", _errors_figure(data), figures)),
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
    return _rate_figure(data, data["acceptance"], "accept_rate", ("accepted", "shown"), ".0%", "accepted / shown")


def _rate_figure(data: dict, rows: list, field: str, counts: tuple[str, str], tickformat: str, title: str):
    """A rate per version over time, each point saying the counts it is made of."""
    import plotly.graph_objects as go

    series = _by_version(rows, field)
    if not series:
        return None
    versions = [v["version"] for v in data["versions"]]
    fig = go.Figure(layout=_layout(yaxis=dict(tickformat=tickformat, rangemode="tozero", title=title)))
    part, whole = counts
    for v, (xs, ys, points) in series.items():
        fig.add_scatter(
            x=xs,
            y=ys,
            name=f"v{v}",
            mode="lines+markers",
            line=dict(color=_color(v, versions)),
            customdata=[[r[part], r[whole]] for r in points],
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


def _latency_figure(data: dict):
    """p50 (solid) and p99 (dotted) completion latency per version; a log axis, as a p99 of a
    loaded machine can be a hundred times its p50."""
    import plotly.graph_objects as go

    series = _by_version(data.get("latency", []), "p50_ms")
    if not series:
        return None
    versions = [v["version"] for v in data["versions"]]
    fig = go.Figure(layout=_layout(yaxis=dict(type="log", title="latency (ms)")))
    for v, (xs, _, rows) in series.items():
        for q, dash in (("p50", "solid"), ("p99", "dot")):
            fig.add_scatter(
                x=xs,
                y=[r[f"{q}_ms"] for r in rows],
                name=f"v{v} {q}",
                mode="lines+markers",
                line=dict(color=_color(v, versions), dash=dash),
                customdata=[r["completions"] for r in rows],
                hovertemplate=f"v{v} {q}<br>%{{x}}<br>%{{y:,.0f}} ms of %{{customdata}} completions<extra></extra>",
            )
    return fig


def _errors_figure(data: dict):
    """Share of served choices the engine did not finish, per version."""
    return _rate_figure(data, data.get("latency", []), "error_rate", ("errors", "choices"), ".1%", "errors / choices")


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
    """Completions, and events stacked by type and source: one colour per type, an inferred
    event (the sink's reading of the user's next request) hatched beside the editor's own."""
    import plotly.graph_objects as go

    vol = data["volume"]
    if not vol["completions"] and not vol["events"]:
        return None
    fig = go.Figure(layout=_layout(barmode="stack", yaxis=dict(title=f"per {_duration(data['bucket_s'])}")))
    kinds = sorted({e["type"] for e in vol["events"]})
    for kind, source in sorted({(e["type"], e["source"]) for e in vol["events"]}):
        mine = [e for e in vol["events"] if (e["type"], e["source"]) == (kind, source)]
        inferred = source == INFERRED
        fig.add_bar(
            x=[_short(e["t"]) for e in mine],
            y=[e["n"] for e in mine],
            name=f"{kind} events (inferred)" if inferred else f"{kind} events",
            marker=dict(color=PALETTE[kinds.index(kind) % len(PALETTE)], pattern=dict(shape="/" if inferred else "")),
            opacity=0.8,
        )
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
        ("events", t["events"] - t["inferred_events"]),
        ("inferred events", t["inferred_events"]),
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


def login_html(status: int, message: str) -> str:
    """The login form (a POST of the ops token to `login`), titled for a 401, 403 or 429."""
    title = {403: "Forbidden", 429: "Too many failed logins"}.get(status, "Log in")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Flywheel ops dashboard: {title}</title><style>{CSS}
main {{ display: block; max-width: 560px; }} form {{ display: flex; gap: 8px; margin-top: 12px; }} input[type=password] {{ flex: 1; padding: 6px; }}
</style></head>
<body><header><h1>Flywheel ops dashboard</h1></header>
<main><section><h2>{title}</h2><p id="message">{_e(message)}</p>
<form method="post" action="login"><input type="password" name="token" placeholder="ops token" autocomplete="current-password" required autofocus>
<button type="submit">Log in</button></form></section></main></body></html>
"""
