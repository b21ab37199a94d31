"""`flywheel` commands of the feedback package (registered by ops/cli/main.py; heavy imports stay inside the commands).

flywheel sink                                  Kafka -> SQL, exactly-once rows, rewards, dead letters
flywheel query "SQL" [--format table|csv|json] read-only SQL over the tables and v_* views
flywheel retention                             drop old text, dead letters and held events now
flywheel bench ingest [--events N] [--batch N]  HTTP -> Kafka -> sink -> SQL against the producer and direct inserts
"""

from __future__ import annotations

import argparse
import logging
import sys

from feedback.core.errors import UserError
from ops.cli.console import add_config_args, bench_subcommands, console, print_config


def register(sub: argparse._SubParsersAction) -> None:
    """Add this package's commands to the `flywheel` parser."""
    p = sub.add_parser(
        "sink",
        help="store completions and events from Kafka in SQL (exactly once), compute rewards",
        description="Consume flywheel.completions and flywheel.events into the database in batches, exactly once per row; "
        "dead-letter what cannot be stored; compute rewards when feedback windows close. Settings: the [sink] section.",
    )
    add_config_args(p)
    p.set_defaults(fn=cmd_sink)

    q = sub.add_parser(
        "query",
        help="run a read-only SQL query (tables and the v_* analyst views)",
        description="Run one read-only SQL statement and print the result. Writes and DDL are refused. "
        "Views: v_daily_acceptance, v_version_rewards, v_latency, v_suggestion_rate, v_choice_feedback; "
        "implicit feedback apart: v_choice_feedback_inferred, v_daily_acceptance_inferred, v_inferred_agreement.",
    )
    q.add_argument("sql", help='e.g. "SELECT * FROM v_daily_acceptance ORDER BY day DESC"')
    q.add_argument("--format", choices=["table", "csv", "json"], default="table", help="output format (default: table)")
    add_config_args(q)
    q.set_defaults(fn=cmd_query)

    r = sub.add_parser(
        "retention",
        help="drop text older than sink.retention_days (token ids stay), and old dead letters and held events",
        description="Apply the retention setting now: NULL prompt, suggestion and edited text older than "
        "sink.retention_days. Token ids, lengths and rewards stay. The sink also does this periodically.",
    )
    add_config_args(r)
    r.set_defaults(fn=cmd_retention)

    b = bench_subcommands(sub).add_parser(
        "ingest",
        help="events/s and ingest lag through Kafka and the sink, against direct inserts",
        description="Ingest benchmark: events through Kafka and the sink into SQL, beside direct batched inserts "
        "into the same database, in one run; throughput ratio and created-to-stored lag p50/p99.",
    )
    b.add_argument("--events", type=int, default=20_000, help="events per path (default 20000)")
    b.add_argument(
        "--database", metavar="URL", help="database to write (default: a fresh SQLite file in the data folder)"
    )
    b.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    b.add_argument(
        "--via",
        choices=["http", "producer"],
        default="http",
        help="how events enter: POST /v1/events/batch on the real API (default), or the producer directly",
    )
    b.add_argument(
        "--batch",
        type=int,
        default=100,
        help="events per HTTP request (default 100; 1 sends each alone to POST /v1/events)",
    )
    b.add_argument("--clients", type=int, default=8, help="concurrent HTTP clients (default 8)")
    b.add_argument(
        "--paced-rate",
        type=float,
        metavar="EVENTS_PER_S",
        help="rate of the paced phase (default: half the flat-out rate); at most --events are sent",
    )
    b.add_argument(
        "--paced-seconds", type=float, default=10.0, metavar="S", help="length of the paced phase (default 10)"
    )
    add_config_args(b)
    b.set_defaults(fn=cmd_bench_ingest)


def _logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    logging.getLogger("kafka").setLevel(logging.ERROR)  # reconnect chatter while a broker restarts
    logging.getLogger("alembic").setLevel(logging.WARNING)


def cmd_sink(args: argparse.Namespace) -> int:
    from feedback.sink.loop import SinkSettings, run_sink

    s = SinkSettings.load(args.config, args.overrides)
    print_config(s, "flywheel sink")
    _logging()
    run_sink(
        s, progress=lambda msg: console.print(msg, markup=False, highlight=False, soft_wrap=True), handle_signals=True
    )
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    from feedback.query import QuerySettings, run_query, table_width, to_csv, to_json, to_table

    s = QuerySettings.load(args.config, args.overrides)
    result = run_query(s.database_url, args.sql, role=s.query.role, statement_timeout_s=s.query.statement_timeout_s)
    if args.format == "csv":
        sys.stdout.write(to_csv(result))
    elif args.format == "json":
        sys.stdout.write(to_json(result) + "\n")
    elif console.is_terminal:
        console.print(to_table(result))
    else:  # piped: no terminal width to respect, so never fold a cell
        from rich.console import Console

        Console(width=max(80, table_width(result)), highlight=False).print(to_table(result))
    return 0


def cmd_retention(args: argparse.Namespace) -> int:
    from datetime import UTC, datetime

    from feedback import db
    from feedback.sink import retention
    from feedback.sink.loop import SinkSettings

    s = SinkSettings.load(args.config, args.overrides)
    print_config(s, "flywheel retention")
    cfg, now = s.sink, datetime.now(UTC)
    engine = db.make_engine(s.database_url)
    db.upgrade(engine)
    with engine.begin() as conn:
        dropped = (
            retention.apply_retention(conn, now=now, retention_days=cfg.retention_days) if cfg.retention_days else None
        )
        deleted = retention.delete_bookkeeping(
            conn,
            now=now,
            dead_letter_days=cfg.dead_letter_retention_days,
            dead_letter_max_rows=cfg.dead_letter_max_rows,
            pending_days=cfg.pending_retention_days,
        )
    engine.dispose()
    if dropped is None:
        console.print("text retention is off (sink.retention_days = 0): text is kept")
    else:
        console.print(f"retention ({cfg.retention_days} days): set to NULL {retention.describe(dropped)}")
    console.print(f"bookkeeping: deleted {retention.describe(deleted)}")
    return 0


def cmd_bench_ingest(args: argparse.Namespace) -> int:
    from feedback.sink.loop import SinkSettings
    from ops.bench.ingest import print_result, run_ingest_bench

    s = SinkSettings.load(args.config, args.overrides)
    print_config(s, "flywheel bench ingest")
    _logging()
    progress = lambda m: console.print(m, markup=False, soft_wrap=True)  # noqa: E731
    if (args.paced_rate is not None and args.paced_rate <= 0) or args.paced_seconds <= 0:
        raise UserError("--paced-rate and --paced-seconds must be positive")
    sender = None
    if args.via == "http":
        from ops.bench.ingest_http import HttpEventSender

        logging.getLogger("httpx").setLevel(logging.WARNING)
        if not 1 <= args.batch <= 100_000 or args.clients < 1:
            raise UserError("--batch must be 1 to 100000 and --clients at least 1")
        sender = HttpEventSender(s, concurrency=args.clients, batch=args.batch)
        progress(
            f"events enter over HTTP: POST {sender.url}{sender.route}, {args.batch} per request from "
            f"{args.clients} clients (the real API app and its buffered producer)"
        )
    try:
        result = run_ingest_bench(
            s,
            n_events=args.events,
            database_url=args.database,
            progress=progress,
            send_events=sender.send if sender else None,
            events_topic=sender.topic if sender else None,
            send_chunk=sender.chunk if sender else 100,
            refused=(lambda: sender.errors) if sender else (lambda: 0),
            paced_rate=args.paced_rate,
            paced_s=args.paced_seconds,
        )
    finally:
        if sender is not None:
            sender.close()

    print_result(result, console)
    if args.out:
        import json
        from dataclasses import asdict

        with open(args.out, "w") as f:
            json.dump(asdict(result), f, indent=2)
    return 0
