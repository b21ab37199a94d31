"""`flywheel soak`: the loop under injected faults, then the checks.

    1. its own stack, in a fresh folder <data_dir>/soak/<time>: a Kafka broker on free ports, the
       database (a SQLite file there, or a throwaway PostgreSQL server), the weight store;
    2. the base model (cached, or pretrained first);
    3. the loop: `flywheel sink` and `flywheel learn` as their own processes, the API under Ray
       Serve with a stable and a canary pool of vLLM replicas, the rollout controller in auto
       mode, simulated editors that keep a ledger of every call;
    4. the faults (ops/soak/faults.py), one after another with calm between them, for
       `soak.minutes` (the first round always completes); then the editors stop and the soak
       waits for what they were answered to reach SQL;
    5. the checks (ops/soak/checks.py) and their table; non-zero exit if one fails.

It never touches the stack `flywheel up` runs: everything it starts is its own and is stopped
at the end. The folder keeps the logs, the SQLite database and the weight store for a look
afterwards; a throwaway PostgreSQL server is deleted with its data.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
import time
from pathlib import Path

from pydantic import SecretStr
from rich.console import Console

from feedback.core.errors import UserError
from feedback.core.files import private_dir
from ops.soak import checks as C
from ops.soak.children import Child, child_env
from ops.soak.faults import Fault, Loop, inject
from ops.soak.postgres import ThrowawayPostgres
from ops.soak.settings import SoakSettings

log = logging.getLogger("flywheel.soak")

CHILD_SECTIONS = ("kafka", "database", "pretrain", "learn", "sink")


def run(s: SoakSettings, console: Console, result: dict | None = None) -> int:
    """Run the soak; 0 when every check passed. `result`, if given, receives the faults and checks."""
    from feedback import db
    from learner import store as S
    from learner.train.pretrain import ensure_base_model, load_training_corpus, pretrain_section
    from ops import kafka_broker, stack
    from ops.rollout.controller import run_controller
    from ops.routes import ops_routers
    from serving import app

    _refuse_what_cannot_run(s)
    t0 = time.time()
    folder = private_dir(s.data_dir / "soak" / time.strftime("%Y%m%d-%H%M%S", time.localtime(t0)))
    pg = (
        ThrowawayPostgres(s.soak.postgres_bin, os_user=s.soak.postgres_os_user, port=_free_port())
        if s.soak.database == "postgresql"
        else None
    )
    r: SoakSettings | None = None
    stop = threading.Event()
    children: list[Child] = []
    threads: list[threading.Thread] = []
    serving_started = False
    say = _printer(console)
    try:
        console.rule("1/5 the soak's own stack")
        with console.status("starting it") as status:
            if pg is not None:
                status.update("initdb and start a throwaway PostgreSQL server")
            url = pg.start() if pg is not None else f"sqlite:///{folder / 'flywheel.db'}"
            r = _own_settings(s, folder, url)
            up = stack.up(r, status.update)
        console.print(
            f"folder {folder}; Kafka {r.kafka.bootstrap} (pid {up.broker_pid}); database {up.database} (revision {up.revision})"
        )

        console.rule("2/5 base model")
        base = ensure_base_model(r, console)
        model_dir = base if (base / "config.json").is_file() else base / "hf"

        console.rule("3/5 the loop")
        engine = db.make_engine(r.database_url)
        env = child_env(r, CHILD_SECTIONS)
        sink = Child("sink", ["sink"], env, log=folder / "sink.log", cwd=folder)
        # The learner shares the cores with the vLLM engines, as in the demo: one torch thread.
        learner = Child("learner", ["learn"], env | {"OMP_NUM_THREADS": "1"}, log=folder / "learner.log", cwd=folder)
        children += [sink, learner]
        for c in children:
            c.start()
        with console.status("the learner publishes the base as v0"):
            _wait_for_v0(engine, learner, s.soak.fault_timeout_s)
        editor = secrets.token_urlsafe(24)  # this run's tokens; never written anywhere
        serve = r.serve.model_copy(
            update={
                "auth_tokens": [SecretStr(editor)],
                "ops_tokens": [SecretStr(secrets.token_urlsafe(24))],
                "model_dir": model_dir,
            }
        )
        with console.status("starting Ray Serve and vLLM (stable and canary pools)") as status:
            serving_started = True
            api = app.start(r.model_copy(update={"serve": serve}), model_dir, 0, status.update, routers=ops_routers())
        console.print(f"sink pid {sink.pid}, learner pid {learner.pid}; API at {api}; logs in {folder}")

        store = S.settings_store(r)
        loop = Loop(r, engine, store, sink, learner, pg, say)
        sites = _sites(load_training_corpus(pretrain_section(r)).heldout, r)
        editors_done = threading.Event()
        ledger: dict = {}
        threads += [
            _thread("rollout controller", say, run_controller, r, stop, progress=lambda m: log.info(m)),
            _thread("editors", say, _editors, api, editor, sites, r, editors_done, ledger),
            _thread("supervisor", say, _supervise, children, stop, say, ledger, t0),
        ]
        for t in threads:
            t.start()

        console.rule(f"4/5 faults, for {s.soak.minutes:g} minutes")
        faults = _schedule(loop, t0 + s.soak.minutes * 60, say)
        editors_done.set()
        threads[1].join(timeout=_editor_drain_s(r))
        calls = list(ledger["stats"].calls) if "stats" in ledger else []
        say(f"editors stopped: {len(calls)} calls; waiting for what they were answered to reach SQL")
        left = _drain(engine, calls, s.soak.drain_timeout_s)
        if left:
            say(f"{left} answered calls still not in SQL after {s.soak.drain_timeout_s:g} s: the checks will name them")
        stop.set()
        for c in children:
            c.stop(timeout_s=60)

        console.rule("5/5 checks")
        ev = gather(engine, store, calls, faults, loop.damaged, children)
        results = C.check_all(ev)
        console.print(C.fault_table(faults, t0))
        console.print(C.check_table(results))
        passed = all(c.ok for c in results)
        console.print(
            f"{'[green]soak passed[/]' if passed else '[red]soak FAILED[/]'} in {time.time() - t0:.0f} s "
            f"({s.soak.minutes:g} minutes asked); the run's folder: {folder}"
        )
        if result is not None:
            result.update(faults=faults, checks=results, folder=folder, evidence=ev)
        return 0 if passed else 1
    finally:
        stop.set()
        for c in children:
            c.stop(timeout_s=30)
        for t in threads:
            t.join(timeout=30)
        if serving_started:
            app.stop()
        if r is not None:
            kafka_broker.stop(r)
        if pg is not None:
            pg.close()


def _refuse_what_cannot_run(s: SoakSettings) -> None:
    if "corrupt_delta" in s.soak.faults and s.serve.canary_replicas < 1:
        raise UserError(
            "the corrupt_delta fault rolls a damaged version out to the canary pool: set serve.canary_replicas "
            "to 1 or more, or leave corrupt_delta out of soak.faults"
        )
    if not s.soak.faults:
        raise UserError("soak.faults is empty: a soak injects at least one fault")


def _own_settings(s: SoakSettings, folder: Path, database_url: str) -> SoakSettings:
    """`s` moved into the soak's own world: its folder, a broker of its own on free ports, its
    database, the API on a free port. The cache (Kafka's jars, the base model) is shared."""
    kafka = s.kafka.model_copy(update={"bootstrap_servers": "", "port": _free_port(), "controller_port": _free_port()})
    serve = s.serve.model_copy(update={"port": _free_port()})
    database = s.database.model_copy(update={"url": database_url})
    return s.model_copy(update={"data_dir": folder, "kafka": kafka, "serve": serve, "database": database})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_v0(engine, learner: Child, timeout_s: float) -> None:
    from sqlalchemy import select

    from feedback import db

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gone = learner.watch()
        if gone is not None:
            raise UserError(f"flywheel learn exited during start-up (exit {gone.code}): {gone.last_line}")
        try:
            with engine.connect() as conn:
                if conn.execute(select(db.model_versions.c.version).where(db.model_versions.c.version == 0)).first():
                    return
        except Exception as e:  # the learner migrates the database as it starts
            log.debug("waiting for v0: %s", e)
        time.sleep(1.0)
    raise UserError(f"the learner did not publish v0 within {timeout_s:.0f} s (its log: {learner.log})")


def _sites(heldout, r: SoakSettings):
    """A few hundred cursor sites the editors go round (as many as the run needs would hold a copy
    of a file each)."""
    import random

    from learner.judge import cursor_sites

    return cursor_sites(heldout, 500, random.Random(r.simulate.seed))


def _editors(api: str, token: str, sites, r: SoakSettings, done: threading.Event, ledger: dict) -> None:
    from ops.simulate import run_sessions

    def keep(stats) -> None:
        ledger["stats"] = stats  # the same object all along: the supervisor reads its progress

    ledger["stats"] = asyncio.run(
        run_sessions(api, token, sites, r.simulate, progress=keep, stop=done.is_set, requests=0)
    )


def _editor_drain_s(r: SoakSettings) -> float:
    """How long the editors' last calls may take: a call, its retries, an edit's delay."""
    sim = r.simulate
    return sim.edit_delay_s + (sim.event_retries + 2) * (sim.timeout_s + 1 + sim.event_retries) + 30


def _schedule(loop: Loop, ends_at: float, say) -> list[Fault]:
    """Faults in `soak.faults` order, `gap_s` apart, after `warmup_s`; rounds repeat while time
    remains, and the first round always completes. Returns when `ends_at` has passed."""
    soak = loop.s.soak
    say(f"warming up for {soak.warmup_s:g} s")
    time.sleep(soak.warmup_s)
    out: list[Fault] = []
    i = 0
    while i < len(soak.faults) or time.time() < ends_at:
        kind = soak.faults[i % len(soak.faults)]
        say(f"fault {i + 1}: {kind}")
        f = inject(kind, loop)
        out.append(f)
        say(f"fault {i + 1}: {kind}: {f.outcome}: {f.detail}")
        i += 1
        time.sleep(soak.gap_s)
    time.sleep(max(0.0, ends_at - time.time()))
    return out


def _drain(engine, calls, timeout_s: float) -> int:
    """Wait until every answered completion and accepted event is in SQL (or dead-lettered); the
    number still outstanding when it returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sql = sql_evidence(engine)
            left = C.outstanding(calls, sql["completion_rows"], sql["event_rows"], sql["dead_letters"], sql["pending"])
        except Exception as e:  # the database may still be recovering from a fault
            log.debug("draining: %s", e)
            left = -1
        if left == 0 or time.monotonic() >= deadline:
            return max(left, 0) if left >= 0 else len(calls)
        time.sleep(2.0)


def _supervise(children: list[Child], stop: threading.Event, say, ledger: dict, t0: float) -> None:
    """Restart a child that ended on its own (and say so); a progress line every half minute."""
    last = time.monotonic()
    while not stop.wait(1.0):
        for c in children:
            gone = c.watch()
            if gone is not None:
                say(f"{c.name} exited on its own (exit {gone.code}: {gone.last_line}); started again as pid {c.pid}")
        if time.monotonic() - last >= 30 and "stats" in ledger:
            st, last = ledger["stats"], time.monotonic()
            say(
                f"{time.time() - t0:.0f} s: {st.requests} completions asked, {st.shown} shown, {st.events} events; "
                f"failed: {st.failure_line()}"
            )


def _thread(name: str, say, fn, *args, **kwargs) -> threading.Thread:
    def body() -> None:
        try:
            fn(*args, **kwargs)
        except Exception as e:
            log.exception("the %s stopped", name)
            say(f"the {name} stopped: {type(e).__name__}: {e}")

    return threading.Thread(target=body, name=name, daemon=True)


def _printer(console: Console):
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            console.print(line, markup=False, highlight=False)

    return say


# --- the evidence -----------------------------------------------------------------------------------


def sql_evidence(engine) -> dict:
    """What SQL holds of completions, events, dead letters and held events."""
    from collections import Counter

    from sqlalchemy import select

    from feedback import db

    with engine.connect() as conn:
        rows = conn.execute(select(db.completions.c.completion_id, db.completions.c.model_version)).all()
        events = conn.execute(select(db.events.c.event_id)).scalars().all()
        d = db.dead_letters.c
        dead = conn.execute(select(d.event_id, d.reason, d.error).where(d.event_id.is_not(None))).all()
        pending = set(conn.execute(select(db.pending_events.c.event_id)).scalars())
    dead_letters: dict[str, list[str]] = {}
    for e in dead:
        dead_letters.setdefault(e.event_id, []).append(f"{e.reason}: {e.error}" if e.reason else "")
    return {
        "completion_rows": Counter(r.completion_id for r in rows),
        "served_by": Counter(r.model_version for r in rows),
        "event_rows": Counter(events),
        "dead_letters": dead_letters,
        "pending": pending,
    }


def gather(engine, store, calls, faults, damaged: set[int], children: list[Child]) -> C.Evidence:
    from sqlalchemy import select

    from feedback import db

    sql = sql_evidence(engine)
    with engine.connect() as conn:
        recorded = {
            r.version: r.sha256 for r in conn.execute(select(db.model_versions.c.version, db.model_versions.c.sha256))
        }
        e = db.swap_events.c
        swaps = [
            C.Swap(w.pool, w.to_version, bool(w.ok), w.error)
            for w in conn.execute(select(e.pool, e.to_version, e.ok, e.error))
        ]
    stored, errors = {}, {}
    for v in store.versions():
        try:
            stored[v] = store.model_version(v).sha256
            store.verify(v)
            errors[v] = None
        except Exception as ex:
            stored.setdefault(v, "")
            errors[v] = f"{type(ex).__name__}: {ex}"[:300]
    return C.Evidence(
        calls=calls,
        faults=faults,
        completion_rows=sql["completion_rows"],
        served_by=sql["served_by"],
        event_rows=sql["event_rows"],
        dead_letters=sql["dead_letters"],
        pending=sql["pending"],
        recorded=recorded,
        stored=stored,
        verify_errors=errors,
        damaged=set(damaged),
        swaps=swaps,
        processes={c.name: (c.kills, list(c.exits)) for c in children},
    )
