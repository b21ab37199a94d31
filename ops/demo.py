"""`flywheel demo` (what `make demo` runs): the main job end to end, as far as it is built.

  1. the local stack: a real Kafka broker, its topics, the SQL schema;
  2. the base model: the cached pretrained one, or `flywheel pretrain` (about 30 minutes);
  3. the feedback sink (Kafka -> SQL, rewards) and the Ray Serve + vLLM API;
  4. simulated editors replaying held-out files over HTTP: completions, views, accepts,
     dismissals and edits, all through Kafka into SQL;
  5. a summary read back from the analyst views.

The learner, hot swaps and canary rollouts join this loop as they land.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import threading
import time

from pydantic import SecretStr
from rich.console import Console
from rich.table import Table

from feedback.sink import SinkSection, SinkSettings
from learner.pretrain_settings import PretrainSettings
from ops import stack
from ops.simulate import SimulateSection, SimulateSettings


class DemoSettings(SimulateSettings, SinkSettings, PretrainSettings):
    """`flywheel demo`: every section the loop uses (serve, sink, pretrain, simulate), with
    defaults sized for one machine and a few minutes: short feedback windows, a modest load."""

    sink: SinkSection = SinkSection(feedback_window_s=15.0, grace_period_s=60.0)
    simulate: SimulateSection = SimulateSection(requests=60, users=4, rate=3.0, edit_delay_s=2.0)


def run(s: DemoSettings, console: Console) -> int:
    from feedback.query import run_query, to_table
    from feedback.sink import run_sink
    from learner.corpus import load_corpus
    from learner.pretrain import ensure_base_model
    from ops.simulate import cursor_sites, run_sessions
    from serving import app

    t_start = time.monotonic()
    console.rule("1/5 stack")
    with console.status("starting the stack") as status:
        r = stack.up(s, status.update)
    console.print(f"Kafka {s.kafka.bootstrap}; database {r.database} (revision {r.revision})")

    console.rule("2/5 base model")
    model_dir = ensure_base_model(s, console)

    console.rule("3/5 sink and serving")
    stop_sink = threading.Event()
    sink = threading.Thread(target=run_sink, args=(s,), kwargs={"stop": stop_sink, "progress": lambda m: console.print(m, markup=False)}, daemon=True)
    sink.start()
    token = secrets.token_urlsafe(24)  # this run's editor token; never written anywhere
    serving = s.model_copy(update={"serve": s.serve.model_copy(update={"auth_tokens": [SecretStr(token)], "model_dir": model_dir})})
    with console.status("starting Ray Serve and vLLM") as status:
        url = app.start(serving, model_dir, serving.serve.model_version, status.update)
    console.print(f"API at {url} serving model v{serving.serve.model_version} from {model_dir}")

    try:
        console.rule("4/5 simulated editors")
        sim = s.simulate
        sites = cursor_sites(load_corpus(s.pretrain.corpus).heldout, sim.requests, random.Random(sim.seed))
        with console.status("") as status:
            stats = asyncio.run(
                run_sessions(
                    url, token, sites, users=sim.users, rate=sim.rate, edit_delay_s=sim.edit_delay_s, max_tokens=sim.max_tokens, seed=sim.seed,
                    progress=lambda st: status.update(f"{st.requests}/{len(sites)} requests, {st.shown} shown, {st.accepted} accepted"),
                )
            )
        console.print(
            f"{stats.requests} requests over HTTP: suggestion rate {stats.suggestion_rate:.0%}, accept rate {stats.accept_rate:.0%}, "
            f"{stats.accepted_chars} accepted characters, {stats.events} events sent, {stats.errors} errors"
        )
        console.print(demo_table(stats))
        # Rewards are computed when each completion's feedback window closes.
        wait = s.sink.feedback_window_s + 2 * s.sink.sweep_interval_s + s.sink.max_batch_wait_s
        with console.status(f"waiting {wait:.0f} s for the feedback windows to close"):
            time.sleep(wait)
    finally:
        app.stop()
        stop_sink.set()
        sink.join(timeout=30)

    console.rule("5/5 what the analysts see")
    for title, sql in (
        (
            "acceptance by version and language (v_daily_acceptance)",
            "SELECT day, model_version AS version, language, shown, accepted, ROUND(accept_rate, 3) AS accept_rate, "
            "accepted_chars FROM v_daily_acceptance ORDER BY day, version, language",
        ),
        (
            "reward by version (v_version_rewards)",
            "SELECT model_version AS version, rewarded, ROUND(mean_reward, 3) AS mean_reward, accepted, edited, dismissed, "
            "no_suggestion FROM v_version_rewards ORDER BY version",
        ),
        (
            "latency by version, ms (v_latency)",
            "SELECT model_version AS version, requests, ROUND(p50_ms) AS p50, ROUND(p90_ms) AS p90, ROUND(p99_ms) AS p99 FROM v_latency ORDER BY version",
        ),
        (
            "suggestion rate (v_suggestion_rate)",
            "SELECT model_version AS version, language, requests, suggested, ROUND(suggestion_rate, 3) AS rate FROM v_suggestion_rate",
        ),
    ):
        result = run_query(s.database_url, sql)
        table = to_table(result)
        table.title = title
        console.print(table)
    rows = run_query(s.database_url, "SELECT COUNT(*) AS completions FROM completions").rows[0][0]
    console.print(
        f"[green]done[/] in {time.monotonic() - t_start:.0f} s: {rows} completions in SQL. "
        "Query them with `flywheel query \"SELECT ...\"`; `flywheel down` stops the broker."
    )
    return 0 if stats.errors == 0 and stats.requests == len(sites) else 1


def demo_table(stats) -> Table:
    t = Table("version", "requests", "shown", "accepted", "accepted chars", title="what the simulated editors saw, per model version")
    for v, row in sorted(stats.by_version.items()):
        t.add_row(v, str(row["requests"]), str(row["shown"]), str(row["accepted"]), str(row["accepted_chars"]))
    return t
