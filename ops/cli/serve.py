"""`flywheel` commands of the serving package (registered by ops/cli/main.py; heavy imports stay inside the commands)."""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

from feedback.core.errors import UserError
from ops.cli.console import add_config_args, bench_subcommands, console, print_config, progress_line


def register(sub: argparse._SubParsersAction) -> None:
    """Add this package's commands to the `flywheel` parser."""
    p = sub.add_parser(
        "serve",
        help="run the completion API (Ray Serve + vLLM)",
        description="run the completion API (Ray Serve + vLLM)",
    )
    add_config_args(p)
    p.set_defaults(fn=cmd_serve)

    w = sub.add_parser(
        "swap",
        help="swap all: every user to one version, replicas swap in place (no rollout)",
        description="Swap all, for when no rollout controller runs: point the stable pool at VERSION of the weight store "
        "for every user and end any canary. The replicas swap in place within about serve.pool_poll_s.",
    )
    w.add_argument("version", nargs="?", type=int, metavar="VERSION", help="a version published in the weight store")
    w.add_argument("--status", action="store_true", help="show the pools' targets and the last swaps instead")
    w.add_argument("--last", type=int, default=10, metavar="N", help="swap events that --status shows (default 10)")
    add_config_args(w)
    w.set_defaults(fn=cmd_swap)

    b = bench_subcommands(sub).add_parser(
        "serve",
        help="serving overhead: bare vLLM AsyncLLM vs Flywheel over HTTP through Ray Serve",
        description="Serving overhead: the same model, load and machine, bare vLLM AsyncLLM in-process "
        "against Flywheel over HTTP through Ray Serve, in one run.",
    )
    b.add_argument("--requests", type=int, default=128, help="requests per side (default 128)")
    b.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    b.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (default 16)")
    b.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    add_config_args(b)
    b.set_defaults(fn=cmd_bench_serve)

    im = bench_subcommands(sub).add_parser(
        "implicit",
        help="implicit feedback: how often the outcome inferred from the next request agrees with explicit events",
        description="On a stack of its own (Kafka, SQLite, the sink, Ray Serve with vLLM), simulated editors walk "
        "down held-out files sending explicit events; per outcome (kept fully, partly, not), how often the sink's "
        "inferred outcome agrees, with Wilson 95%% intervals, and why the rest were not judged.",
    )
    im.add_argument("--requests", type=int, help="completions in all (simulate.requests)")
    im.add_argument("--model-dir", type=Path, help="a Hugging Face model folder to serve (default: the cached base)")
    im.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    add_config_args(im)
    im.set_defaults(fn=cmd_bench_implicit)

    lc = bench_subcommands(sub).add_parser(
        "longctx",
        help="long context: full context vs truncation vs self-summary on held-out files",
        description="Completions whose answer was defined far back in a held-out file: full context (where it fits), "
        "truncation to the budget, and self-summary to the same budget, on one engine in one run.",
    )
    lc.add_argument("--examples", type=int, default=60, help="held-out examples (default 60)")
    lc.add_argument("--budget", type=int, default=96, help="prompt tokens for truncation and self-summary (default 96)")
    lc.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (default 16)")
    lc.add_argument("--seed", type=int, default=0)
    lc.add_argument(
        "--beyond-window",
        action="store_true",
        help="truncation against self-summary as serving builds them, on files of at least 4 windows whose "
        "answer was defined beyond the window (--budget is then serving's own)",
    )
    lc.add_argument("--out", metavar="FILE", help="also write the results as JSON")
    add_config_args(lc)
    lc.set_defaults(fn=cmd_bench_longctx)


def load_settings(args: argparse.Namespace):
    from serving.settings import ServingSettings

    return ServingSettings.load(args.config, args.overrides)


def check_ready(s) -> Path:
    """Refuse to start without editor tokens or a model, or on a busy port: one line each."""
    from ops.kafka_broker import port_free

    try:
        tokens = s.serve.editor_tokens()
        s.serve.editor_token_users()
    except ValueError as e:
        raise UserError(str(e)) from None
    if not tokens and not s.serve.allow_anonymous:
        raise UserError(
            "no editor tokens configured: set serve.auth_tokens_file (one token per line) or "
            "FLYWHEEL_SERVE__AUTH_TOKENS='[\"...\"]' (or serve.allow_anonymous=true for local development)"
        )
    try:
        s.serve.ops_token_set()
    except ValueError as e:
        raise UserError(str(e)) from None
    model_dir = resolve_model_dir(s)
    cfg = s.serve
    if not cfg.ray_address:  # a local Ray would wait forever for replicas it has no CPUs for
        cpus = cfg.ray_num_cpus or os.cpu_count() or 1
        need = (cfg.replicas + cfg.canary_replicas) * cfg.engine.num_cpus
        if need > cpus:
            raise UserError(
                f"{cfg.replicas} stable + {cfg.canary_replicas} canary replica(s) x {cfg.engine.num_cpus:g} CPU need {need:g} CPUs, "
                f"but the local Ray has {cpus}: lower serve.replicas or serve.canary_replicas (0: no canary pool), or serve.engine.num_cpus"
            )
    if not port_free(s.serve.host, s.serve.port):
        raise UserError(
            f"port {s.serve.port} on {s.serve.host} is already in use; choose another with --set serve.port=..."
        )
    return model_dir


def resolve_model_dir(s) -> Path:
    """The weight store's version when the store holds a model (serving/model_source.py), else
    `serve.model_dir`, else the cached pretrained base; UserError if there is none of them."""
    from serving.model_source import store_model_folder

    if (folder := store_model_folder(s)) is not None:
        return folder
    model_dir = s.serve.model_dir
    if model_dir is None:
        from learner.train.pretrain import find_base_model

        base = find_base_model(s)
        if base is None:
            raise UserError(
                "no model to serve: run `flywheel pretrain` first, or set serve.model_dir to an exported model folder"
            )
        model_dir = base / "hf"
    if not (Path(model_dir) / "config.json").is_file():
        raise UserError(f"serve.model_dir {model_dir} is not an exported model folder (no config.json)")
    return Path(model_dir)


def cmd_serve(args: argparse.Namespace) -> int:
    s = load_settings(args)
    model_dir = check_ready(s)
    print_config(s, "flywheel serve")
    from learner.formats import read_format
    from ops.routes import ops_routers
    from serving import app
    from serving.replica import format_line

    try:
        fmt = read_format(model_dir, fim=s.model.fim)
    except ValueError as e:
        raise UserError(f"{model_dir}: {e}") from None
    console.print(f"model {model_dir}: {format_line(fmt)}", markup=False, soft_wrap=True)
    update, status = progress_line()
    with status:
        url = app.start(s, model_dir, s.serve.model_version, update, routers=ops_routers())
    console.print(
        f"[green]serving[/] model v{s.serve.model_version} at {url}/v1/completions (health: {url}/v1/health, metrics: {url}/metrics)"
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    console.print("shutting down")
    app.stop()
    return 0


def cmd_swap(args: argparse.Namespace) -> int:
    from feedback import db, pools

    if (args.version is None) == (not args.status):
        raise UserError("give either a VERSION to move every user to, or --status")
    s = load_settings(args)
    if not args.status:
        _check_published(s, args.version)
    engine = db.make_engine(s.database_url)
    db.upgrade(engine)  # idempotent; one line when the database is unreachable
    if args.status:
        _print_swap_status(engine, args.last)
        return 0
    before = pools.read(engine)
    pools.set_stable(engine, args.version)
    ended = (
        f"; the canary on v{before.canary} ({before.canary_percent:g}% of users) is ended"
        if before.canary is not None
        else ""
    )
    console.print(
        f"[green]set[/] stable pool -> v{args.version} for every user{ended}. Replicas swap in place within ~{s.serve.pool_poll_s:g} s; "
        "`flywheel swap --status` shows the swaps."
    )
    return 0


def _check_published(s, version: int) -> None:
    """UserError unless `version` is a stable version of the weight store the replicas read."""
    from learner.store import settings_store

    uri = s.store_uri
    try:
        versions = settings_store(s).versions()
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the weight store {uri}: {e}") from None
    if version not in versions:
        have = f"it has {', '.join(f'v{v}' for v in versions[-8:])}" if versions else "it is empty"
        raise UserError(
            f"version {version} is not in the weight store {uri} ({have}); publish it first (`flywheel learn`)"
        )


def _print_swap_status(engine, last: int) -> None:
    from rich.markup import escape
    from rich.table import Column, Table
    from sqlalchemy import select

    from feedback import db

    with engine.connect() as conn:
        rows = list(conn.execute(select(db.serving_pools).order_by(db.serving_pools.c.pool.desc())))
        events = list(conn.execute(select(db.swap_events).order_by(db.swap_events.c.id.desc()).limit(max(0, last))))
    when = "%Y-%m-%d %H:%M:%S"
    t = Table("pool", "target", "users %", "rollout", "updated", title="serving_pools (targets)")
    for r in rows:
        t.add_row(
            r.pool,
            "-" if r.version is None else f"v{r.version}",
            f"{r.traffic_percent:g}",
            "-" if r.rollout_id is None else str(r.rollout_id),
            r.updated_at.strftime(when),
        )
    console.print(t if rows else "serving_pools: no targets set; each pool serves the version it was deployed with")
    e = Table(
        Column("at", no_wrap=True),
        "pool",
        "replica",
        Column("swap", no_wrap=True),
        "pause ms",
        "drain + reload ms",
        "tensors",
        "fetched",
        "result",
        title=f"swap_events (last {len(events)})",
    )
    for ev in events:
        e.add_row(
            ev.at.strftime("%m-%d %H:%M:%S"),
            ev.pool,
            ev.replica.rsplit("#", 1)[-1],
            f"v{ev.from_version} -> v{ev.to_version}",
            f"{ev.pause_s * 1e3:.0f}",
            "-" if ev.drain_s is None else f"{ev.drain_s * 1e3:.0f} + {ev.reload_s * 1e3:.0f}",
            str(ev.tensors_reloaded),
            _size(ev.fetched_bytes),
            "[green]ok[/]" if ev.ok else f"[red]failed[/]: {escape(ev.error or '')}",
        )
    console.print(e if events else "swap_events: no swaps yet")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import json

    from rich.table import Table

    from ops.bench import serving as bench_serving

    s = load_settings(args)
    model_dir = resolve_model_dir(s)
    print_config(s, "flywheel bench serve")
    r = bench_serving.run(
        s, model_dir, n=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens, progress=console.print
    )
    t = Table(
        "path",
        "req/s",
        "tokens/s",
        "p50 ms",
        "p99 ms",
        "errors",
        title=f"serving overhead ({r['requests']} requests, concurrency {r['concurrency']}, {r['max_tokens']} tokens)",
    )
    for side in (r["bare"], r["flywheel"]):
        t.add_row(
            side["name"],
            f"{side['rps']:.1f}",
            f"{side['tokens_per_s']:.0f}",
            f"{side['p50_ms']:.0f}",
            f"{side['p99_ms']:.0f}",
            str(side["errors"]),
        )
    console.print(t)
    console.print(f"throughput ratio Flywheel / bare vLLM: {r['throughput_ratio']:.2f}")
    console.print(stage_table(r["bare"]["stages"], r["flywheel"]["stages"]))
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=2))
    return 0


def stage_table(bare: dict, fly: dict):
    """Where a request's time goes, per stage, on both sides (ops/bench/serving.py: breakdown)."""
    from rich.table import Table

    t = Table(
        "stage",
        "bare mean ms",
        "Flywheel mean ms",
        "Flywheel p50 ms",
        "share of Flywheel's client time",
        title="where a request's time goes (serving/http/timing.py; means add up, ttft lies within engine)",
    )
    client = fly.get("client", {}).get("mean_ms") or 0.0
    for stage in dict.fromkeys([*fly, *bare]):
        b, f = bare.get(stage), fly.get(stage)
        t.add_row(
            stage,
            f"{b['mean_ms']:.1f}" if b else "",
            f"{f['mean_ms']:.1f}" if f else "",
            f"{f['p50_ms']:.1f}" if f else "",
            f"{f['mean_ms'] / client:.0%}" if f and client and stage not in ("client", "ttft") else "",
        )
    return t


def cmd_bench_implicit(args: argparse.Namespace) -> int:
    from ops.bench.implicit import BenchImplicitSettings, run_bench

    overrides = list(args.overrides) + ([f"simulate.requests={args.requests}"] if args.requests else [])
    s = BenchImplicitSettings.load(args.config, overrides)
    print_config(s, "flywheel bench implicit")
    run_bench(s, console, model_dir=args.model_dir, out=args.out)
    return 0


def cmd_bench_longctx(args: argparse.Namespace) -> int:
    import json

    from rich.table import Table

    from ops.bench import longctx as bench_longctx

    s = load_settings(args)
    model_dir = resolve_model_dir(s)
    print_config(s, "flywheel bench longctx")
    try:
        r = bench_longctx.run(
            s,
            model_dir,
            n=args.examples,
            budget=args.budget,
            max_tokens=args.max_tokens,
            seed=args.seed,
            progress=console.print,
            beyond_window=args.beyond_window,
        )
    except ValueError as e:
        raise UserError(str(e)) from None
    t = Table(
        "strategy",
        "exact match",
        "edit similarity",
        "prompt tokens",
        "summary fallbacks",
        title=f"long context ({r['mode']}): {r['examples']} held-out examples, definitions "
        f"{r['distance_tokens'][0]}-{r['distance_tokens'][1]} tokens back, budget {r['budget']} tokens, window {r['window']}",
    )
    for row in r["results"]:
        t.add_row(
            row["strategy"],
            f"{row['exact_match']:.1%}",
            f"{row['edit_similarity']:.3f}",
            f"{row['prompt_tokens']:.0f}",
            str(row["fallbacks"]),
        )
    console.print(t)
    c = r["summary_vs_truncation"]
    console.print(
        f"self-summary against truncation, paired over {c['examples']} examples: edit similarity "
        f"{c['similarity_diff']:+.3f} (one-sided p = {c['similarity_p']:.3g}); exact match right only with "
        f"summaries {c['exact_only_better']}, only with truncation {c['exact_only_other']} (p = {c['exact_p']:.3g})"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(r, indent=2))
    return 0
