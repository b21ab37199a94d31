"""The `flywheel` command line. Entrypoints stay thin and import heavy modules late.

Every command takes `--config FILE` and repeated `--set section.key=value` overrides.
Errors the user can fix print one line (`flywheel: error: ...`) and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import NoReturn

from feedback.core.errors import UserError
from feedback.core.threads import prefer_passive_waiting
from ops.cli import dashboard, feedback, learner, rollout, serve
from ops.cli.console import add_config_args, console, err_console, print_config, progress_line

# Each group of commands is its own light module: `register(subparsers)` adds parsers whose
# `fn(args) -> int` imports the heavy code only when it runs.
COMMAND_MODULES = (learner, feedback, serve, rollout, dashboard)


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line, not a usage block."""

    def error(self, message: str) -> NoReturn:
        err_console.print(f"flywheel: error: {message} (see `{self.prog} --help`)", markup=False, soft_wrap=True)
        sys.exit(2)


def _stack_settings(args: argparse.Namespace):
    from feedback.core.config import StackSettings

    return StackSettings.load(args.config, args.overrides)


# --- commands ---------------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace) -> int:
    from ops import stack

    s = _stack_settings(args)
    print_config(s, "flywheel up")
    update, status = progress_line()
    with status:
        r = stack.up(s, update)
    where = f"local broker pid {r.broker_pid}" if r.broker_pid else "external cluster"
    console.print(
        f"[green]up[/]: Kafka at {s.kafka.bootstrap} ({where}); database {r.database} at revision {r.revision}"
    )
    if r.created_topics:
        console.print(f"created topics: {', '.join(r.created_topics)}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from ops import stack

    s = _stack_settings(args)
    pid = stack.down(s)
    if pid is None:
        console.print("nothing to stop: no broker started by `flywheel up` is running")
    else:
        console.print(f"[green]down[/]: stopped Kafka broker (pid {pid}); data kept in {s.data_dir / 'kafka'}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ops import stack

    s = _stack_settings(args)
    st = stack.status(s)
    kind = f"local broker, pid {st.broker_pid}" if st.kafka_managed else "external cluster"
    health = "[green]healthy[/]" if st.kafka_healthy else f"[red]down[/]: {st.kafka_error}"
    console.print(
        f"Kafka    {st.kafka_bootstrap} ({kind if st.broker_pid or not st.kafka_managed else 'local broker'}): {health}"
    )
    if st.topics:
        t = Table("topic", "partitions", "retention.ms", "cleanup.policy")
        for ti in st.topics:
            t.add_row(ti.name, str(ti.partitions), ti.retention_ms, ti.cleanup_policy)
        console.print(t)
    if st.db_error:
        console.print(f"Database {st.database}: [red]unreachable[/]: {st.db_error}")
    else:
        mark = (
            "[green]up to date[/]"
            if st.db_revision == st.db_head
            else f"[yellow]needs `flywheel db upgrade`[/] (head {st.db_head})"
        )
        console.print(f"Database {st.database}: revision {st.db_revision}, {mark}")
    return 0 if st.healthy else 1


def cmd_db(args: argparse.Namespace) -> int:
    from feedback import db

    s = _stack_settings(args)
    engine = db.make_engine(s.database_url)
    before = db.current_revision(engine)
    db.upgrade(engine, args.revision)
    after = db.current_revision(engine)
    url = engine.url.render_as_string(hide_password=True)
    engine.dispose()
    if before == after:
        console.print(f"database {url} already at revision {after}")
    else:
        console.print(f"[green]migrated[/] database {url}: {before or 'empty'} -> {after}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ops import demo

    overrides = list(args.overrides)
    if args.base is not None:
        overrides.append(f"model.base={json.dumps(str(Path(args.base).expanduser().absolute()))}")
    s = demo.DemoSettings.load(args.config, overrides)
    print_config(s, "flywheel demo")
    return demo.run(s, console)


def cmd_soak(args: argparse.Namespace) -> int:
    from ops.soak.run import run
    from ops.soak.settings import SoakSettings

    flags = {"minutes": args.minutes, "database": args.database}
    overrides = list(args.overrides) + [f"soak.{k}={json.dumps(v)}" for k, v in flags.items() if v is not None]
    s = SoakSettings.load(args.config, overrides)
    print_config(s, "flywheel soak")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The soak stops the broker on purpose: kafka-python's connection errors would bury its own lines.
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    return run(s, console)


def cmd_simulate(args: argparse.Namespace) -> int:
    import asyncio
    import random

    from learner.corpus import load_corpus
    from learner.judge import cursor_sites, file_walks
    from ops.simulate import SimulateSettings, run_sessions
    from serving.settings import ServingSettings

    class Settings(SimulateSettings, ServingSettings):
        """`flywheel simulate`: editor traffic against a running API."""

    s = Settings.load(args.config, args.overrides)
    print_config(s, "flywheel simulate")
    sim = s.simulate
    url = sim.url or f"http://{s.serve.host}:{s.serve.port}"
    token = sim.token.get_secret_value() or next(iter(sorted(s.serve.editor_tokens())), "")
    if not token:
        raise UserError("no editor token: set simulate.token, or serve.auth_tokens / serve.auth_tokens_file")
    try:
        corpus = load_corpus(sim.corpus)
    except ValueError as e:
        raise UserError(str(e)) from None
    rng = random.Random(sim.seed)
    walks = file_walks(corpus.heldout, sim.requests, rng, per_file=sim.walk_sites) if sim.same_file else None
    sites = [] if walks is not None else cursor_sites(corpus.heldout, sim.requests, rng)
    update, status = progress_line()
    with status:
        stats = asyncio.run(
            run_sessions(
                url,
                token,
                sites,
                sim,
                walks=walks,
                progress=lambda st: update(
                    f"{st.requests} requests, {st.shown} shown, {st.accepted} accepted, failed: {st.failure_line()}"
                ),
            )
        )
    console.print(
        f"{stats.requests} requests: suggestion rate {stats.suggestion_rate:.1%}, accept rate {stats.accept_rate:.1%}, "
        f"{stats.accepted_chars} accepted characters, {stats.events} events; failed: {stats.failure_line()}"
    )
    return 0 if stats.errors == 0 else 1


def build_parser() -> Parser:
    p = Parser(prog="flywheel", description="Online-learning serving for code completion.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    for name, fn, help_ in [
        ("up", cmd_up, "start the local stack (Kafka broker, topics, database schema)"),
        ("down", cmd_down, "stop what `up` started (data is kept)"),
        ("status", cmd_status, "show the health of Kafka, its topics and the database"),
        ("simulate", cmd_simulate, "replay held-out code files as editor sessions against the API"),
    ]:
        sp = sub.add_parser(name, help=help_, description=help_)
        add_config_args(sp)
        sp.set_defaults(fn=fn)

    demo = sub.add_parser("demo", help="run the main job end to end", description="run the main job end to end")
    demo.add_argument(
        "--base",
        metavar="PATH",
        help="run it on an imported Hugging Face model instead of the pretrained base (model.base)",
    )
    add_config_args(demo)
    demo.set_defaults(fn=cmd_demo)

    sp = sub.add_parser(
        "soak",
        help="run the loop while faults are injected, then check that nothing was lost",
        description="The whole loop in a folder of its own (broker, database, weight store), with simulated editors, "
        "while a schedule stops the broker, SIGKILLs the sink and the learner, restarts PostgreSQL, kills a model "
        "replica and plants a damaged version; then checks SQL and the store against what the editors were answered. "
        "Settings: the [soak] section.",
    )
    sp.add_argument("--minutes", type=float, help="how long the editors work while faults are injected (soak.minutes)")
    sp.add_argument(
        "--database",
        choices=["sqlite", "postgresql"],
        help="a SQLite file, or a throwaway PostgreSQL server the soak restarts as a fault (soak.database)",
    )
    add_config_args(sp)
    sp.set_defaults(fn=cmd_soak)

    dbp = sub.add_parser("db", help="database schema migrations", description="database schema migrations")
    dbsub = dbp.add_subparsers(dest="db_command", required=True, metavar="ACTION", parser_class=Parser)
    upg = dbsub.add_parser("upgrade", help="migrate the schema (Alembic) to the newest revision")
    upg.add_argument("revision", nargs="?", default="head")
    add_config_args(upg)
    upg.set_defaults(fn=cmd_db)

    for module in COMMAND_MODULES:
        module.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    prefer_passive_waiting()  # before any command imports torch (feedback/core/threads.py)
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UserError as e:
        err_console.print(f"flywheel: error: {e}", markup=False, soft_wrap=True)
        return e.exit_code
    except KeyboardInterrupt:
        err_console.print("flywheel: interrupted")
        return 130
    except Exception as e:  # a bug: still one line, with the way to see more
        if os.environ.get("FLYWHEEL_DEBUG"):
            raise
        err_console.print(
            f"flywheel: internal error: {type(e).__name__}: {e} (set FLYWHEEL_DEBUG=1 for the traceback)",
            markup=False,
            soft_wrap=True,
        )
        return 70


if __name__ == "__main__":
    sys.exit(main())
