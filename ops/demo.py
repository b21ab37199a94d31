"""`flywheel demo` (what `make demo` runs): the whole loop on one machine, end to end.

  1. the local stack: a real Kafka broker, its topics, the SQL schema;
  2. the base model: the cached pretrained one, or `flywheel pretrain` (about 30 minutes); or,
     with `model.base` (`flywheel demo --base PATH`), an imported Hugging Face model, which the
     learner makes v0 of the weight store (learner/base.py) and serving then serves;
  3. the feedback sink (Kafka -> SQL, rewards) and the Ray Serve API: a stable and a canary
     pool of vLLM replicas;
  4. the loop, for `demo.minutes`: simulated editors replay held-out files over HTTP; the
     learner trains on their rewarded feedback and publishes a gated version every
     `learn.publish_every` (minutes here, hours in production); the rollout controller in auto
     mode canaries each one and promotes or rolls it back from the SQL evidence. Once the first
     learned version's rollout has ended, the demo also publishes a deliberately degraded
     candidate (what stable serves, with the output layer negated and the gate skipped) to show
     the automatic rollback;
  5. a summary: per version accept rate, reward, suggestion rate, accepted characters; delta
     sizes against full; swap pauses; every rollout decision with its evidence; and the held-out
     evaluation of `flywheel eval` (learner.eval.evaluate, with 95% intervals) of the base and
     of the version stable serves at the end, on `eval.sites` sites (200 here, not 500: two
     replays of 500 would add minutes to a ten-minute demo); and each served version's
     train-inference mismatch on the completions it served, with serving's routes replayed and
     without (learner.train.mismatch);
  6. a static copy of the ops dashboard.

Everything runs for real: vLLM engines in Ray Serve, a Kafka broker, SQLite (or the
configured database). The learner, the controller and the sink run as threads of this process
so one command shows the loop; in production each is its own process (`flywheel learn`,
`flywheel rollout run --auto`, `flywheel sink`, `flywheel serve`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import Field, SecretStr
from rich.console import Console
from rich.table import Table
from sqlalchemy import text

from feedback.core.config import Section
from feedback.sink.loop import SinkSection, SinkSettings
from learner.train.eval_settings import EvalSection, EvalSettings
from learner.train.learn_settings import GateSection, LearnSection, LearnSettings, ShowSection
from ops import stack
from ops.rollout.settings import RolloutSection, RolloutSettings, Thresholds
from ops.simulate import SimulateSection, SimulateSettings
from serving.settings import ServingSettings

log = logging.getLogger("flywheel.demo")


class DemoSection(Section):
    minutes: float = Field(default=7.0, gt=0)
    """How long the simulated editors type (the loop runs while they do)."""
    degraded_candidate: bool = True
    """Publish a deliberately degraded version once the first learned one's rollout has ended, to show a rollback."""
    dashboard: Path | None = None
    """Where the static dashboard goes. Empty: <data_dir>/dashboard.html."""
    mismatch_completions: int = Field(default=128, ge=0)
    """The summary measures each served version's train-inference mismatch, with serving's routes
    replayed and without (learner/train/mismatch.py), on this many of the newest completions it
    served. 0: not measured."""
    background_nice: int = Field(default=10, ge=0, le=19)
    """Niceness of the demo's own background threads (the learner, the sink, the rollout
    controller; Linux schedules threads, and a thread's niceness is its own), so that on one
    shared machine they yield the CPU to serving. In production they run elsewhere. 0: as is."""


class DemoSettings(SimulateSettings, ServingSettings, SinkSettings, LearnSettings, EvalSettings, RolloutSettings):
    """`flywheel demo`: every section the loop uses, with defaults sized for one 2-core machine
    and about ten minutes: short feedback windows, a version every 90 s, two 20-second canary steps."""

    demo: DemoSection = DemoSection()
    sink: SinkSection = SinkSection(feedback_window_s=10.0, grace_period_s=60.0)
    simulate: SimulateSection = SimulateSection(users=6, rate=1.5, edit_delay_s=2.0, max_tokens=16)
    # A version every 48 samples: its show policy (learner/show.py) is fitted from 32 outcomes on,
    # so that the first learned version already has one. The gate replays 48 sites: on 16, stable
    # showed 3 suggestions, and a policy that withheld 2 of them (30% of 81 on 200 sites) was
    # blocked for abstaining.
    learn: LearnSection = LearnSection(
        publish_every=90.0,
        min_samples=48,
        gate=GateSection(sites=48, min_sites=16, max_tokens=16, max_kl=0.5),
        show=ShowSection(min_samples=32, min_each=4),
    )
    # The production rule promotes a version only once its accept rate is shown within 2 points
    # of stable's, which takes about 1,200 shown choices per arm; the demo's steps gather a few
    # dozen, so under it every demo version held at its last step until its holds or the run ran out.
    # The demo promotes on expected loss instead: once the accept rate users would lose on average
    # by promoting, under each arm's posterior, is at most 2 points. An equal version needs about
    # 150 shown choices per arm for that; one that looks better, fewer. On "no significant harm"
    # (`promote_rule = "no_harm"`) the demo promoted versions that looked worse, once the injected
    # fault itself. Two steps, half the users and then all, so that a rollout ends (and the
    # injected fault's after it) within the demo's minutes.
    rollout: RolloutSection = RolloutSection(
        auto=True,
        weights=[50.0, 100.0],
        interval_s=20.0,
        min_samples=8,
        max_holds=8,
        poll_s=2.0,
        promote_rule="expected_loss",
        thresholds=Thresholds(accept_rate_loss=0.02),
    )
    eval: EvalSection = EvalSection(sites=200, token_accuracy=False)  # a 1536-token prompt's forward each


def run(
    s: DemoSettings, console: Console, result: dict | None = None, *, until: Callable[[], bool] | None = None
) -> int:
    """Run the demo; 0 when every simulated request succeeded. `result`, if given, receives the
    summary (per version, published versions, swaps, rollouts) and the simulated editors' stats.
    `until`, if given, ends the loop early once it returns True (demo.minutes stays the bound)."""
    import torch

    from feedback import db
    from feedback.sink.loop import run_sink
    from learner.judge import cursor_sites
    from learner.train.learn import Learner, describe
    from learner.train.pretrain import ensure_base_model
    from ops.dashboard import write_static
    from ops.rollout.controller import run_controller
    from ops.routes import ops_routers
    from ops.simulate import run_sessions
    from serving import app
    from serving.model_source import store_model_folder

    t_start = time.monotonic()
    console.rule("1/6 stack")
    with console.status("starting the stack") as status:
        r = stack.up(s, status.update)
    console.print(f"Kafka {s.kafka.bootstrap}; database {r.database} (revision {r.revision})")

    console.rule("2/6 base model")
    serving_dtype = app.engine_precision(s.serve)
    if s.model.base is not None:
        pretrained_dir, trained_in = None, None
        _check_imported_base(s, console)
    else:
        run_dir = ensure_base_model(s, console)
        pretrained_dir = run_dir if (run_dir / "config.json").is_file() else run_dir / "hf"
        trained_in = _base_precision(pretrained_dir)

    console.rule("3/6 sink, learner and serving")
    engine = db.make_engine(s.database_url)
    stop = threading.Event()
    events: list[str] = []
    nice = s.demo.background_nice
    threads = [_background("sink", console, events, run_sink, s, stop=stop, progress=lambda m: log.info(m), nice=nice)]
    threads[0].start()
    torch.set_num_threads(1)  # the learner shares two cores with two vLLM engines
    learner = Learner(s, progress=lambda p: p.event.startswith("published") and _say(console, events, describe(p)))
    learner.start()
    console.print(
        f"learner at v{learner.state.version} (last good v{learner.state.last_good}), step {learner.state.step}; store {learner.store.uri()}"
    )
    editor, ops_token = (
        secrets.token_urlsafe(24),
        secrets.token_urlsafe(24),
    )  # this run's tokens; never written anywhere
    serve = s.serve.model_copy(
        update={"auth_tokens": [SecretStr(editor)], "ops_tokens": [SecretStr(ops_token)], "model_dir": None}
    )
    serving = s.model_copy(update={"serve": serve})
    # The store's v0, which the learner published: never a folder the store does not hold.
    model_dir = store_model_folder(serving) or pretrained_dir
    with console.status("starting Ray Serve and vLLM (stable and canary pools)") as status:
        url = app.start(serving, model_dir, 0, status.update, routers=ops_routers())
    console.print(f"API at {url}; stable and canary pools start on v0 and follow serving_pools")

    console.rule(f"4/6 the loop: {s.demo.minutes:g} minutes of simulated editors")
    sim = s.simulate
    n = max(1, int(s.demo.minutes * 60 * sim.rate))
    sites = cursor_sites(learner.heldout, n, random.Random(sim.seed))
    threads.append(_background("learner", console, events, learner.run, stop, nice=nice))
    threads.append(
        _background(
            "rollout controller",
            console,
            events,
            run_controller,
            s,
            stop,
            progress=lambda m: _say(console, events, m),
            nice=nice,
        )
    )
    if s.demo.degraded_candidate:
        threads.append(
            _background("fault injection", console, events, _inject_degraded, learner, engine, stop, console, events)
        )
    for t in threads[1:]:
        t.start()
    stats = None
    try:
        with console.status("") as status:
            t0 = time.monotonic()

            def show(st) -> None:
                lp = learner.snapshot()
                status.update(
                    f"{time.monotonic() - t0:.0f}/{s.demo.minutes * 60:.0f} s · {st.requests}/{n} requests, {st.shown} shown, {st.accepted} accepted, "
                    f"failed: {st.failure_line()} · learner v{lp.version} step {lp.step}, {lp.trained_since_publish}/{lp.min_samples} samples "
                    f"for the next version"
                )

            # The loop ends on time however slow requests get; a request slower than the editors'
            # timeout is counted as failed, with its reason, and the loop goes on.
            stats = asyncio.run(
                run_sessions(
                    url,
                    editor,
                    sites,
                    sim,
                    progress=show,
                    deadline=t0 + s.demo.minutes * 60,
                    stop=_at_most_every_second(until),
                )
            )
            wait = s.sink.feedback_window_s + 2 * s.sink.sweep_interval_s + s.sink.max_batch_wait_s
            status.update(f"waiting {wait:.0f} s for the last feedback windows to close")
            time.sleep(wait)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        learner.close()
        app.stop()

    console.rule("5/6 summary")
    summary = summarize(engine, console)
    summary["simulated"] = {
        "requests": stats.requests,
        "errors": stats.errors,
        "failed_completions": stats.failed_completions,
        "failures": dict(stats.failures),
        "shown": stats.shown,
        "accepted": stats.accepted,
        "latency": stats.latency_summary(),
        "stages": stats.stage_summary(),
    }
    summary["precision"] = {"serving": serving_dtype.dtype, "pretraining": trained_in}
    summary["events"] = events
    summary["heldout"] = evaluate_versions(learner, engine, s.eval, console, min_confidence=s.model.min_confidence)
    if s.demo.mismatch_completions:
        summary["served_mismatch"] = served_mismatch_report(learner, engine, console, s.demo.mismatch_completions)
    if result is not None:
        result.update(summary)
    print_machine_report(console, stats, serving_dtype, trained_in, timeout_s=sim.timeout_s)

    console.rule("6/6 dashboard")
    path = write_static(engine, s.demo.dashboard or s.data_dir / "dashboard.html")
    console.print(
        f"static dashboard: {path} (live: {url}/ops/dashboard with an ops token, while `flywheel serve` runs)"
    )
    console.print(
        f'[green]done[/] in {time.monotonic() - t_start:.0f} s. `flywheel query "SELECT ..."` reads the tables; `flywheel down` stops the broker.'
    )
    answered = stats.requests - stats.failed_completions
    return 0 if answered > 0 else 1


def print_machine_report(console: Console, stats, serving_dtype, trained_in: str | None, *, timeout_s: float) -> None:
    """What the editors felt, per version (client-side latency), what failed and why, and the dtypes:
    the lines that say whether this machine kept up."""
    t = Table(
        "version", "answered", "p50 ms", "p99 ms", title="completion latency (as the simulated editors measured it)"
    )
    lat = stats.latency_summary()
    for v, row in lat.items():
        t.add_row(v, str(int(row["n"])), f"{row['p50_ms']:.0f}", f"{row['p99_ms']:.0f}")
    console.print(t)
    if stages := stats.stage_summary():
        console.print(stage_table(stages))
    console.print(
        f"simulated editors: {stats.requests} requests over HTTP, {stats.failed_completions} failed"
        + (f" ({stats.skipped} planned ones not started: time was up)" if stats.skipped else "")
        + f"; suggestion rate {stats.suggestion_rate:.0%}, accept rate {stats.accept_rate:.0%}, {stats.accepted_chars} accepted characters; "
        f"failures: {stats.failure_line()}",
        markup=False,
    )
    console.print(f"dtype: serving {serving_dtype}; base pretrained in {trained_in or 'unknown'}", markup=False)
    worst = max((row["p99_ms"] for row in lat.values()), default=0.0)
    struggling = []
    if stats.failed_completions:
        struggling.append(f"{stats.failed_completions} of {stats.requests} completions failed ({stats.failure_line()})")
    if worst > timeout_s * 1000 / 4:
        struggling.append(f"completion p99 reached {worst / 1000:.1f} s (editors give up after {timeout_s:g} s)")
    if struggling:
        console.print(
            f"[yellow]this machine is struggling[/]: {'; '.join(struggling)}. Fewer simulated users (simulate.users, "
            "simulate.rate) or a longer simulate.timeout_s would ease it."
        )


def stage_table(stages: dict) -> Table:
    """Mean ms per stage (serving/http/timing.py) over every answered completion and over the
    slowest 5%: whether the tail waited in the engine, in Ray Serve or in the HTTP front."""
    everyone, slowest = stages["all"], stages["slowest"]
    t = Table(
        "stage",
        f"all {everyone['client']['n']} (mean ms)",
        f"slowest {slowest['client']['n']} (mean ms)",
        title="where completion time went (Server-Timing; ttft lies within engine)",
    )
    for stage, row in everyone.items():
        tail = slowest.get(stage)
        t.add_row(stage, f"{row['mean_ms']:.0f}", f"{tail['mean_ms']:.0f}" if tail else "")
    return t


def _at_most_every_second(until: Callable[[], bool] | None) -> Callable[[], bool] | None:
    """`until` asked at most once a second (the editors ask before each request), True once it was."""
    if until is None:
        return None
    seen = {"at": float("-inf"), "done": False}

    def check() -> bool:
        if not seen["done"] and time.monotonic() - seen["at"] >= 1.0:
            seen["at"], seen["done"] = time.monotonic(), bool(until())
        return seen["done"]

    return check


def _check_imported_base(s: DemoSettings, console: Console) -> None:
    """Refuse an imported base before anything starts (architecture, tokenizer, shards, and the
    memory the learner and both pools' replicas need); the learner imports it."""
    from feedback.core.errors import UserError
    from learner.base import check_base, check_memory, physical_memory
    from serving.replica import format_line

    try:
        info = check_base(s.model.base, fim=s.model.fim)
        gib = s.model.memory_gib
        check_memory(
            info,
            replicas=s.serve.replicas + s.serve.canary_replicas,
            available=int(gib * 2**30) if gib else physical_memory(),
        )
    except ValueError as e:
        raise UserError(str(e)) from None
    console.print(
        f"imported base {info.folder} ({info.args.architecture}, {info.parameters / 1e6:,.1f}M parameters): no pretraining. "
        f"{format_line(info.format)}",
        markup=False,
    )


def evaluate_versions(learner, engine, cfg: EvalSection, console: Console, *, min_confidence: float = 0.0) -> dict:
    """`flywheel eval`'s evaluation of the base (v0) and of the version stable serves now, on the
    same held-out sites, with serving's confidence gate and each version's show policy
    (learner/show.py), printed side by side with their intervals; returns their summaries."""
    from feedback import pools
    from learner import eval as E
    from learner.train.learn import model_from_packed

    with engine.connect() as conn:
        stable = pools.current_stable(conn) or 0
    names = {0: "v0 (base)"} | ({stable: f"v{stable} (stable)"} if stable else {})
    stats = {}
    with console.status("") as status:
        for v, name in names.items():
            status.update(f"held-out evaluation of v{v}: {cfg.sites} sites")
            model = model_from_packed(learner.store.materialize(v), learner.args)
            stats[name] = E.evaluate(
                model,
                learner.tok,
                learner.format,
                learner.heldout,
                sites=cfg.sites,
                seed=cfg.seed,
                max_tokens=cfg.max_tokens,
                threads=cfg.threads,
                min_confidence=min_confidence,
                cursor=cfg.cursor,
                show_policy=learner.store.show_policy(v),
            )
    title = f"held-out evaluation: {cfg.sites} sites (`flywheel eval --model vN --sites {cfg.sites}`)"
    console.print(E.report_table(stats, title=title))
    out = {name: st.summary() for name, st in stats.items()}
    if stable:  # the same sites: is stable's accept rate of shown above the base's?
        paired = E.paired_accept_ratio(stats[names[0]].results, stats[names[stable]].results)
        out[names[stable]]["vs_base"] = paired.as_dict()
        if paired.p is not None:
            ratio = f"{paired.ratio_text()}, " if paired.ratio is not None else ""
            console.print(
                f"v{stable}'s accept rate of shown against the base's on the same sites: {ratio}"
                f"p {'= ' if paired.p else ''}{paired.p_text()} that it is not above (paired bootstrap, {paired.rounds:,} resamples)",
                markup=False,
            )
    return out


def served_mismatch_report(learner, engine, console: Console, limit: int) -> list[dict]:
    """Each version that served completions, its train-inference mismatch on the newest `limit`
    of them (learner.train.mismatch): its served weights, vLLM's logprobs, serving's routes
    replayed against the forward's own. Printed as a table; returned as rows."""
    from learner.train.learn import model_from_packed
    from learner.train.mismatch import served_mismatch, served_samples

    with engine.connect() as conn:
        served = (
            conn.execute(text("SELECT DISTINCT model_version FROM completions ORDER BY model_version")).scalars().all()
        )
    published = set(learner.store.versions())  # a shared database may hold another store's versions
    rows = []
    with console.status("") as status:
        for v in served:
            if v not in published:
                continue
            samples = served_samples(engine, v, limit, learner.args.vocab_size)
            if not samples:
                continue
            model = model_from_packed(learner.store.materialize(v), learner.args)
            say = lambda n, v=v, total=len(samples): status.update(  # noqa: E731
                f"train-inference mismatch of v{v}: {n}/{total} completions"
            )
            m = served_mismatch(model, learner.args, learner.format, samples, version=v, progress=say)
            if m is not None:
                rows.append(m)
    t = Table(
        "served by",
        "completions",
        "tokens",
        "serving's routes replayed",
        "own routing",
        "replay / own [95% CI]",
        "routes differing",
        title=f"train-inference mismatch KL per token on what each version served (newest {limit}; router replay, R3)",
        caption="replay / own is - where no route differs from the forward's own: replay then changes nothing",
    )
    for m in rows:
        t.add_row(
            f"v{m.version}",
            str(m.completions),
            str(m.tokens),
            f"{m.replay:.1e}",
            f"{m.own:.1e}",
            _ratio_cell(m.ratio, m.ratio_interval),
            f"{m.rerouted:.2%}",
        )
    console.print(t)
    return [m.as_dict() for m in rows]


def _ratio_cell(ratio: float | None, interval: tuple[float, float] | None) -> str:
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x" + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def _base_precision(model_dir: Path) -> str | None:
    """The precision the base was pretrained in (its metrics.json), when recorded."""
    metrics = model_dir.parent / "metrics.json"
    try:
        return json.loads(metrics.read_text()).get("precision")
    except (OSError, ValueError):
        return None


def _background(name: str, console: Console, events: list[str], fn, *args, nice: int = 0, **kwargs) -> threading.Thread:
    """A daemon thread running `fn` at niceness `nice`; if it stops with an error, the demo says so
    and goes on without it."""

    def run() -> None:
        lower_priority(nice)
        try:
            fn(*args, **kwargs)
        except Exception as e:
            log.exception("the %s stopped", name)
            _say(console, events, f"{name} stopped: {type(e).__name__}: {e}")

    return threading.Thread(target=run, name=name, daemon=True)


def lower_priority(nice: int) -> None:
    """Raise the calling thread's niceness to `nice` (Linux; threads it starts inherit it)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:  # never lower it: only privileged users may
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:  # a container may refuse it; the demo runs on at the same priority
        log.warning("could not lower the priority of %s: %s", threading.current_thread().name, e)


def _say(console: Console, events: list[str], line: str) -> None:
    events.append(line)
    console.print(line, markup=False, highlight=False)


def _inject_degraded(learner, engine, stop: threading.Event, console: Console, events: list[str]) -> None:
    """Once the first learned version's rollout has ended (promoted or rolled back), publish a
    deliberately degraded candidate on top of what stable serves."""
    from sqlalchemy import select

    from feedback import db, pools
    from ops.rollout import rows

    while not stop.wait(2.0):
        with engine.connect() as conn:
            ended = conn.execute(
                select(db.rollouts.c.id).where(db.rollouts.c.state.in_((db.PROMOTED, db.ROLLED_BACK))).limit(1)
            ).first()
            busy = rows.active(conn)
        if ended is None or busy is not None:
            continue
        stable = pools.read(engine).stable
        if stable is None:
            continue
        msg = publish_degraded(learner, engine, parent=stable)
        _say(
            console,
            events,
            f"fault injection: published v{msg.version} = v{stable} with its output layer negated (gate skipped on purpose); "
            "the canary should roll it back",
        )
        return


def publish_degraded(learner, engine, *, parent: int):
    """A version whose suggestions are garbage: `parent` with lm_head negated. Recorded and
    announced as passing (it skips the learner's gate, which would block it), so the rollout
    controller must catch it."""
    from learner.publish import publish_version

    packed = learner.store.materialize(parent)
    head = "lm_head.weight" if "lm_head.weight" in packed else "model.embed_tokens.weight"  # tied: the embedding
    packed[head] = -packed[head]
    return publish_version(
        learner.store,
        packed,
        parent=parent,
        engine=engine,
        producer=learner.producer,
        gate_passed=True,
        gate_reason="demo fault injection: lm_head negated, gate skipped",
        metrics={"injected_fault": 1.0},
    )


# --- the summary ----------------------------------------------------------------------------------


def summarize(engine, console: Console) -> dict:
    """Print the loop's outcome from SQL; return it as data (tests read it)."""
    out: dict = {}
    with engine.connect() as conn:
        per_version = conn.execute(
            text(
                "SELECT f.model_version AS v, COUNT(*) AS requests, SUM(f.suggested) AS suggested, SUM(f.shown) AS shown, "
                "SUM(f.accepted) AS accepted, SUM(f.accepted_chars) AS chars FROM v_choice_feedback f GROUP BY f.model_version ORDER BY f.model_version"
            )
        ).all()
        rewards = dict(
            conn.execute(
                text("SELECT model_version, AVG(reward) FROM rewards WHERE outcome <> 'unseen' GROUP BY model_version")
            ).all()
        )
        versions = conn.execute(
            text(
                "SELECT version, parent, kind, size_bytes, full_size_bytes, gate_passed, gate_reason, metrics FROM model_versions ORDER BY version"
            )
        ).all()
        swaps = conn.execute(
            text(
                "SELECT pool, from_version, to_version, ok, pause_s, drain_s, reload_s, restarted, tensors_reloaded, "
                "fetched_bytes, error FROM swap_events ORDER BY id"
            )
        ).all()
        rollouts = conn.execute(
            text("SELECT id, candidate_version, stable_version, state, reason FROM rollouts ORDER BY id")
        ).all()
        steps = conn.execute(
            text("SELECT rollout_id, step_index, weight, decision, evidence FROM rollout_steps ORDER BY id")
        ).all()

    t = Table(
        "version",
        "requests",
        "suggestion rate",
        "accept rate",
        "mean reward",
        "accepted chars / request",
        title="per version (what users saw)",
    )
    out["versions"] = {}
    for r in per_version:
        row = {
            "requests": r.requests,
            "suggestion_rate": (r.suggested or 0) / r.requests,
            "accept_rate": (r.accepted or 0) / max(r.shown or 0, 1),
            "reward": rewards.get(r.v),
            "accepted_chars_per_request": (r.chars or 0) / r.requests,
        }
        out["versions"][r.v] = row
        t.add_row(
            f"v{r.v}",
            str(r.requests),
            f"{row['suggestion_rate']:.0%}",
            f"{row['accept_rate']:.0%}",
            "-" if row["reward"] is None else f"{row['reward']:+.3f}",
            f"{row['accepted_chars_per_request']:.1f}",
        )
    console.print(t)

    t = Table(
        "version",
        "parent",
        "kind",
        "published bytes",
        "full bytes",
        "delta / full",
        "mismatch KL: replay / own",
        "gate",
        title="published versions (the weight store)",
    )
    out["published"] = []
    for v in versions:
        ratio = v.size_bytes / v.full_size_bytes if v.full_size_bytes else 0.0
        out["published"].append(
            {
                "version": v.version,
                "kind": v.kind,
                "size_bytes": v.size_bytes,
                "ratio": ratio,
                "gate_passed": v.gate_passed,
                **{k: _json(v.metrics).get(k) for k in MISMATCH},
            }
        )
        t.add_row(
            f"v{v.version}",
            "-" if v.parent is None else f"v{v.parent}",
            v.kind,
            f"{v.size_bytes:,}",
            f"{v.full_size_bytes:,}",
            f"1/{1 / ratio:.0f}" if ratio and v.kind == "delta" else "full",
            _mismatch(_json(v.metrics)),
            ("passed" if v.gate_passed else "BLOCKED") + (f": {v.gate_reason}" if v.gate_reason and v.version else ""),
        )
    console.print(t)
    pooled = pooled_mismatch([_json(v.metrics) for v in versions])
    if pooled is not None:
        replay, own, updates = pooled
        out["mismatch_pooled"] = {"mismatch_kl_replay": replay, "mismatch_kl_no_replay": own, "updates": updates}
        console.print(
            f"mismatch KL over all {updates} updates: serving's routes replayed {replay:.1e}, own routing {own:.1e}"
            + (f" = {replay / own:.2f}x" if own else ""),
            markup=False,
        )

    t = Table(
        "pool",
        "swap",
        "ok",
        "pause ms",
        "drain + reload ms",
        "restarted",
        "tensors",
        "fetched bytes",
        title="hot swaps (in place, no restart): the pause is the wait for in-flight requests, then the reload",
    )
    out["swaps"] = []
    ms = lambda s: "-" if s is None else f"{s * 1e3:.0f}"  # noqa: E731 (rows before migration 0006 have none)
    for w in swaps:
        out["swaps"].append(
            {
                "pool": w.pool,
                "from": w.from_version,
                "to": w.to_version,
                "ok": bool(w.ok),
                "pause_s": w.pause_s,
                "drain_s": w.drain_s,
                "reload_s": w.reload_s,
                "restarted": w.restarted,
            }
        )
        t.add_row(
            w.pool,
            f"v{w.from_version} -> v{w.to_version}",
            "yes" if w.ok else f"NO: {w.error}",
            f"{w.pause_s * 1e3:.0f}",
            f"{ms(w.drain_s)} + {ms(w.reload_s)}",
            "-" if w.restarted is None else str(w.restarted),
            str(w.tensors_reloaded),
            f"{w.fetched_bytes:,}",
        )
    console.print(t)

    t = Table(
        "rollout", "step", "canary %", "decision", "evidence", title="rollout decisions (rollouts, rollout_steps)"
    )
    out["rollouts"] = [
        {"id": r.id, "candidate": r.candidate_version, "stable": r.stable_version, "state": r.state, "reason": r.reason}
        for r in rollouts
    ]
    cand = {r.id: (r.candidate_version, r.stable_version) for r in rollouts}
    for st in steps:
        c, s_ = cand.get(st.rollout_id, ("?", "?"))
        t.add_row(
            f"#{st.rollout_id} v{c} vs v{s_}",
            str(st.step_index),
            f"{st.weight:g}",
            st.decision,
            _evidence_line(st.evidence),
        )
    console.print(t)
    for r in rollouts:
        console.print(
            f"rollout #{r.id}: v{r.candidate_version} -> {r.state}" + (f" ({r.reason})" if r.reason else ""),
            markup=False,
        )
    learned = [p["version"] for p in out["published"] if p["version"] > 0 and p["gate_passed"]]
    if learned and not rollouts:  # the loop did not close: say so rather than let the tables look fine
        console.print(
            f"no rollout started, though v{learned[0]}-v{learned[-1]} passed the gate: the controller's log says why "
            "(`flywheel rollout status`)",
            style="bold red",
            markup=False,
        )
    return out


MISMATCH = ("mismatch_kl_replay", "mismatch_kl_no_replay", "recorded_routing", "mismatch_updates")
"""The learner's train-inference mismatch over a version's updates (learner.train.learn): replaying
the serving engine's routes (where records carried them) against the FP4 forward's own routing, and
how many updates the means cover."""


def _json(value) -> dict:
    """A JSON column read by a text() query: parsed by PostgreSQL's driver, a string from SQLite."""
    return value if isinstance(value, dict) else json.loads(value or "{}")


def _mismatch(m: dict) -> str:
    replay, own, recorded, updates = (m.get(k) for k in MISMATCH)
    if replay is None or own is None:
        return "-"
    ratio = f" = {replay / own:.2f}x" if own else ""
    over = f", {updates:.0f} updates" if updates else ""
    return f"{replay:.1e} / {own:.1e}{ratio} ({recorded or 0:.0%} serving routes{over})"


def pooled_mismatch(metrics: list[dict]) -> tuple[float, float, int] | None:
    """The mismatch KL with serving's routes replayed and without, over every update of these
    versions (each version's means weighted by its updates), and the updates: one version's few
    updates may hold none of the rare routes the FP4 forward would choose otherwise. None when no
    version recorded its updates."""
    rows = [
        (m["mismatch_kl_replay"], m["mismatch_kl_no_replay"], int(m["mismatch_updates"]))
        for m in metrics
        if m.get("mismatch_updates")
    ]
    n = sum(u for _, _, u in rows)
    if not n:
        return None
    return sum(r * u for r, _, u in rows) / n, sum(o * u for _, o, u in rows) / n, n


def _evidence_line(ev) -> str:
    if isinstance(ev, str):  # a JSON column read through text() comes back as its text on SQLite
        import json

        ev = json.loads(ev)
    if not isinstance(ev, dict):
        return ""
    parts = []
    arms = ev.get("arms") or {}
    for arm in ("canary", "stable"):
        a = arms.get(arm) or {}
        if a:
            acc = f", accept {a['accepted'] / a['shown']:.0%}" if a.get("shown") else ""
            rew = f", reward {a['reward_mean']:+.2f}" if a.get("reward_mean") is not None else ""
            parts.append(f"{arm}: {a.get('shown', 0)} shown{acc}{rew}")
    if ev.get("reason"):
        parts.append(str(ev["reason"]))
    return "; ".join(parts)
