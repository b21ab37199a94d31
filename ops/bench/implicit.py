"""`flywheel bench implicit`: how often the sink's inferred feedback agrees with the editor's own.

One run on a stack of its own, in a fresh folder under <data_dir>/bench/implicit/<time>: a Kafka
broker on free ports, SQLite, the feedback sink (a thread), and Ray Serve with one vLLM replica of
the base model (or `--model-dir`). Simulated editors walk down held-out files
(`simulate.same_file`) and DO send explicit events, so each judged completion has both kinds:
the explicit outcome (what the simulated user did: `learner.judge`) and the inferred one (what
the sink read from the same user's next request: feedback/implicit.py).

Reported, per explicit outcome (kept fully, partly, not): how many completions both kinds judged,
how many of them the inference got right, with a Wilson 95% interval; the full confusion table;
and the completions the inference could not judge, by reason (`feedback.implicit.NotJudged`,
plus `no_next_request`: the last request of a walk, or the next one came after the window).
"""

from __future__ import annotations

import asyncio
import random
import secrets
import threading
import time
from collections import Counter
from pathlib import Path

from pydantic import SecretStr
from rich.console import Console
from rich.table import Table

from feedback.core.files import private_dir
from feedback.sink.loop import SinkSettings
from learner.train.pretrain_settings import PretrainSettings
from ops.simulate import SimulateSettings
from serving.settings import ServingSettings

OUTCOMES = ("full", "partial", "none")
LABELS = {"full": "kept fully", "partial": "kept partly", "none": "not kept"}


class BenchImplicitSettings(SimulateSettings, ServingSettings, SinkSettings, PretrainSettings):
    """`flywheel bench implicit`: [simulate] for the editors, [serve] for the replica, [sink] for the
    feedback window, [pretrain] for the base model (the cached one is the default)."""


def agreement(pairs: list[tuple[str, str]]) -> dict:
    """Per explicit outcome: n, agreeing k and the Wilson 95% interval of k/n; and the confusion
    counts. `pairs` are (explicit, inferred) outcomes. Pure."""
    from learner.eval import wilson

    out: dict = {"per_outcome": {}, "confusion": {}}
    for explicit in OUTCOMES:
        inferred = [i for e, i in pairs if e == explicit]
        k = sum(1 for i in inferred if i == explicit)
        ci = wilson(k, len(inferred))
        out["per_outcome"][explicit] = {
            "n": len(inferred),
            "agree": k,
            "rate": ci.value,
            "low": ci.low,
            "high": ci.high,
        }
        out["confusion"][explicit] = dict(Counter(inferred))
    k = sum(1 for e, i in pairs if e == i)
    total = wilson(k, len(pairs))
    out["overall"] = {"n": len(pairs), "agree": k, "rate": total.value, "low": total.low, "high": total.high}
    return out


def not_judged(engine, *, window_s: float) -> dict[str, dict[str, int]]:
    """Why shown suggestions got no inferred outcome, by the explicit outcome of each: the judge's
    reason for each pair it declined, and `no_next_request` for a completion no later request of
    its user and file followed in the window. Empty suggestions (never shown) are left out.
    Recomputed from SQL with the sink's own pairing and judge."""
    from datetime import UTC, datetime

    from feedback.sink import ingest

    with engine.connect() as conn:
        served = ingest.read_served(
            conn,
            user_hashes=_all_users(conn),
            since=datetime(2000, 1, 1, tzinfo=UTC),
            until=datetime(2100, 1, 1, tzinfo=UTC),
        )
        explicit = explicit_outcomes(conn)
    pairs = ingest.previous_pairs(served, {s.completion_id for s in served}, window_s)
    judged_prev = {prev.completion_id for prev, _ in pairs}
    reasons: dict[str, Counter] = {}

    def add(why: str, completion_id: str) -> None:
        reasons.setdefault(why, Counter())[explicit.get(completion_id, "no explicit event")] += 1

    for prev, nxt in pairs:
        j = ingest.judge_pair(prev, nxt)
        if j is not None and j.not_judged is not None and j.not_judged != "blank":
            add(j.not_judged, prev.completion_id)
    for s in served:
        if s.suggestion and s.suggestion.strip() and s.completion_id not in judged_prev:
            add("no_next_request", s.completion_id)
    return {why: dict(c) for why, c in sorted(reasons.items(), key=lambda kv: -sum(kv[1].values()))}


def explicit_outcomes(conn) -> dict[str, str]:
    """Choice 0's outcome by its explicit events, as v_inferred_agreement names them: a full select
    is `full`, another select or an edit `partial`, a dismiss or a view alone `none`."""
    from sqlalchemy import select

    from feedback import db

    ev = db.events.c
    rank = {"full": 2, "partial": 1, "none": 0}
    out: dict[str, str] = {}
    rows = conn.execute(
        select(ev.completion_id, ev.type, ev.select_kind).where(ev.source == db.EXPLICIT, ev.choice_index == 0)
    )
    for r in rows:
        if r.type == "select" and r.select_kind == "full":
            o = "full"
        elif r.type in ("select", "edit"):
            o = "partial"
        else:
            o = "none"
        if rank[o] >= rank.get(out.get(r.completion_id, "none"), 0):
            out[r.completion_id] = o
    return out


def _all_users(conn) -> list[str]:
    from sqlalchemy import select

    from feedback import db

    return list(conn.execute(select(db.completions.c.user_hash).distinct()).scalars())


def run_bench(s: BenchImplicitSettings, console: Console, *, model_dir: Path | None, out: str | None) -> dict:
    from feedback import db
    from feedback.core.errors import UserError
    from learner.judge import file_walks
    from learner.train.pretrain import ensure_base_model, load_training_corpus, pretrain_section
    from ops import kafka_broker, stack
    from ops.simulate import run_sessions
    from serving import app

    if model_dir is not None and not (model_dir / "config.json").is_file():
        raise UserError(f"--model-dir {model_dir} holds no Hugging Face model (config.json): export one first")
    t0 = time.time()
    folder = private_dir(s.data_dir / "bench" / "implicit" / time.strftime("%Y%m%d-%H%M%S", time.localtime(t0)))
    kafka = s.kafka.model_copy(update={"bootstrap_servers": "", "port": _free_port(), "controller_port": _free_port()})
    token = secrets.token_urlsafe(24)  # this run's editor token; never written anywhere
    r = s.model_copy(
        update={
            "data_dir": folder,
            "kafka": kafka,
            "database": s.database.model_copy(update={"url": f"sqlite:///{folder / 'flywheel.db'}"}),
            "serve": s.serve.model_copy(
                update={
                    "port": _free_port(),
                    "canary_replicas": 0,
                    "auth_tokens": [SecretStr(token)],
                    # Several editors share one token: no per-token limit in the way.
                    "limits": s.serve.limits.model_copy(update={"completions": "", "events": ""}),
                }
            ),
        }
    )
    stop = threading.Event()
    sink_thread = None
    serving = False
    try:
        console.rule("1/4 the bench's own stack")
        with console.status("starting Kafka and the database") as status:
            up = stack.up(r, status.update)
        console.print(f"folder {folder}; Kafka {r.kafka.bootstrap}; database {up.database}")
        if model_dir is None:
            base = ensure_base_model(r, console)
            model_dir = base if (base / "config.json").is_file() else base / "hf"
        corpus = load_training_corpus(pretrain_section(r))

        console.rule("2/4 sink and serving")
        sink_thread = _start_sink(r, stop)
        serve = r.serve.model_copy(update={"model_dir": model_dir})
        with console.status("starting Ray Serve and vLLM") as status:
            serving = True
            url = app.start(r.model_copy(update={"serve": serve}), model_dir, 0, status.update)

        console.rule("3/4 same-file editors, sending explicit events")
        sim = r.simulate.model_copy(update={"same_file": True, "explicit_events": True})
        walks = file_walks(corpus.heldout, sim.requests, random.Random(sim.seed), per_file=sim.walk_sites)
        with console.status("editors") as status:
            stats = asyncio.run(
                run_sessions(
                    url,
                    token,
                    [],
                    sim,
                    walks=walks,
                    progress=lambda st: status.update(
                        f"{st.requests} requests, {st.shown} shown, {st.accepted} accepted, failed: {st.failure_line()}"
                    ),
                )
            )
        console.print(
            f"{stats.requests} requests in {len(walks)} walks: {stats.shown} shown, {stats.accepted} accepted, "
            f"{stats.events} events; failed: {stats.failure_line()}"
        )
        engine = db.make_engine(r.database_url)
        _wait_for_sink(engine, stats, sink_thread, console)

        console.rule("4/4 agreement")
        with engine.connect() as conn:
            rows = conn.exec_driver_sql("SELECT explicit_outcome, inferred_outcome FROM v_inferred_agreement").all()
        result = agreement([(e, i) for e, i in rows])
        result["not_judged"] = not_judged(engine, window_s=r.sink.feedback_window_s)
        result["run"] = {
            "requests": stats.requests,
            "walks": len(walks),
            "shown": stats.shown,
            "failed": stats.failure_line(),
            "model_dir": str(model_dir),
            "seconds": round(time.time() - t0),
        }
        engine.dispose()
        print_result(result, console)
        if out:
            import json

            Path(out).write_text(json.dumps(result, indent=2))
        return result
    finally:
        stop.set()
        if sink_thread is not None:
            sink_thread.join(timeout=60)
        if serving:
            app.stop()
        kafka_broker.stop(r)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_sink(r: BenchImplicitSettings, stop: threading.Event) -> threading.Thread:
    from feedback.sink.loop import SinkSettings, run_sink

    sink = SinkSettings(
        data_dir=r.data_dir,
        cache_dir=r.cache_dir,
        kafka=r.kafka,
        database=r.database,
        sink=r.sink.model_copy(update={"progress_interval_s": 3600.0, "retention_days": 0}),
    )
    t = threading.Thread(target=run_sink, args=(sink,), kwargs={"stop": stop}, name="sink", daemon=True)
    t.start()
    return t


def _wait_for_sink(engine, stats, sink_thread: threading.Thread, console: Console, timeout_s: float = 300.0) -> None:
    """Until every answered completion and event is in SQL (and the counts hold still)."""
    from sqlalchemy import func, select

    from feedback import db

    answered = sum(1 for c in stats.calls if c.kind == "completion" and c.status == 200)
    sent = sum(1 for c in stats.calls if c.kind == "event" and c.status == 200)
    deadline = time.monotonic() + timeout_s
    with console.status("waiting for the sink") as status:
        while time.monotonic() < deadline:
            if not sink_thread.is_alive():
                raise RuntimeError("the sink stopped during the bench")
            with engine.connect() as conn:
                comps = conn.execute(select(func.count()).select_from(db.completions)).scalar()
                evs = conn.execute(
                    select(func.count()).select_from(db.events).where(db.events.c.source == db.EXPLICIT)
                ).scalar()
            status.update(f"the sink has {comps}/{answered} completions, {evs}/{sent} events")
            if comps >= answered and evs >= sent:
                return
            time.sleep(1.0)
    console.print(f"[yellow]the sink had not stored everything after {timeout_s:g} s; measuring what it has[/]")


def print_result(result: dict, console: Console) -> None:
    t = Table(title="implicit feedback against explicit events (same completions)")
    for col in ("explicit outcome", "n", "inferred agrees", "95% interval (Wilson)", "inferred: full / partly / not"):
        t.add_column(col)
    for o in OUTCOMES:
        p, conf = result["per_outcome"][o], result["confusion"][o]
        rate = "-" if p["rate"] is None else f"{p['rate']:.1%}"
        ci = "-" if p["low"] is None else f"{p['low']:.1%} .. {p['high']:.1%}"
        t.add_row(
            LABELS[o], str(p["n"]), f"{p['agree']} ({rate})", ci, " / ".join(str(conf.get(i, 0)) for i in OUTCOMES)
        )
    ov = result["overall"]
    overall = "-" if ov["rate"] is None else f"{ov['rate']:.1%} ({ov['low']:.1%} .. {ov['high']:.1%})"
    t.add_row("all", str(ov["n"]), overall, "", "")
    console.print(t)
    reasons = "; ".join(
        f"{sum(by.values())} {why} ({', '.join(f'{n} {LABELS.get(o, o)}' for o, n in sorted(by.items()))})"
        for why, by in result["not_judged"].items()
    )
    console.print(f"shown suggestions not judged by the inference (by explicit outcome): {reasons or 'none'}")
