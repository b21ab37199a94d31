"""`flywheel rollout ...`: the canary controller and the commands on rollouts (registered by ops/cli/main.py).

    flywheel rollout start VERSION [--weights 5,25,50,100] [--interval 60s] [--min-samples N]
                                   [--alpha A] [--max-holds N] [--promote-rule non_inferior|expected_loss|no_harm]
                                   [--threshold KEY=VALUE]... [--stable V] [--all] [--force]
    flywheel rollout run [--auto]                     the controller loop (settings: [rollout])
    flywheel rollout status [ID] [--json]             the active (else latest) rollout and its steps
    flywheel rollout pause|resume|promote|abort [ID] [--reason TEXT]

The commands talk to the database directly; the same functions serve /ops/rollouts over HTTP.
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import sys

from feedback.core.errors import UserError
from ops.cli.console import add_config_args, console, print_config


def register(sub: argparse._SubParsersAction) -> None:
    """Add `flywheel rollout` and its actions to the `flywheel` parser."""
    p = sub.add_parser(
        "rollout",
        help="canary rollouts: start one, run the controller, pause, resume, promote, abort",
        description="Canary rollouts of model versions: step the canary's traffic share, compare it with stable "
        "(accept rate, reward, suggestion rate, errors, latency) and promote or roll back. Settings: the [rollout] section.",
    )
    actions = p.add_subparsers(dest="rollout_command", required=True, metavar="ACTION", parser_class=type(p))

    s = actions.add_parser(
        "start",
        help="start a rollout of VERSION (canary at the first weight)",
        description="Start a rollout of VERSION.",
    )
    s.add_argument("version", type=int, help="a version in model_versions")
    s.add_argument(
        "--weights", metavar="W1,W2,...", help="canary percent per step (default rollout.weights: 5,25,50,100)"
    )
    s.add_argument("--interval", metavar="DURATION", help="time per step, e.g. 60s, 5m (default rollout.interval_s)")
    s.add_argument("--min-samples", type=int, metavar="N", help="observations per arm before a metric is tested")
    s.add_argument("--alpha", type=float, help="significance level of each one-sided test")
    s.add_argument("--max-holds", type=int, metavar="N", help="under-sampled evaluations per step before rolling back")
    s.add_argument(
        "--promote-rule",
        choices=("non_inferior", "expected_loss", "no_harm"),
        help="what the last step needs to promote: the accept rate shown non-inferior (default), the expected "
        "loss of accept rate at most thresholds.accept_rate_loss, or no significant harm",
    )
    s.add_argument(
        "--threshold",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a tolerance of rollout.thresholds: accept_rate_drop, reward_drop, error_rate_increase, p99_latency_ratio",
    )
    s.add_argument(
        "--stable", type=int, metavar="VERSION", help="the version to compare with (default: the current stable)"
    )
    s.add_argument("--all", action="store_true", help="no canary: make VERSION stable at once (rollout.mode = all)")
    s.add_argument(
        "--force", action="store_true", help="roll out a version that failed the gate or was rolled out before"
    )
    add_config_args(s)
    s.set_defaults(fn=cmd_start)

    r = actions.add_parser(
        "run",
        help="run the controller (until interrupted)",
        description="Evaluate the active rollout every rollout.poll_s and advance, promote or roll it back; "
        "with --auto, also start a rollout for each version announced on flywheel.versions that passed the gate.",
    )
    r.add_argument("--auto", action="store_true", help="roll out announced versions (rollout.auto)")
    add_config_args(r)
    r.set_defaults(fn=cmd_run)

    st = actions.add_parser("status", help="the active (else latest) rollout and its recent steps")
    st.add_argument("id", type=int, nargs="?", help="a rollout id (default: the active one, else the latest)")
    st.add_argument("--json", action="store_true", help="print JSON (with each step's evidence)")
    st.add_argument("--steps", type=int, default=20, help="how many recent steps (default 20)")
    add_config_args(st)
    st.set_defaults(fn=cmd_status)

    for name, help_ in (
        ("pause", "stop advancing the active rollout (traffic stays where it is)"),
        ("resume", "let a paused rollout advance again"),
        ("promote", "make the candidate stable now"),
        ("abort", "send every user back to stable and end the rollout"),
    ):
        a = actions.add_parser(name, help=help_, description=help_)
        a.add_argument("id", type=int, nargs="?", help="a rollout id (default: the active one)")
        a.add_argument("--reason", help="why, for the record")
        add_config_args(a)
        a.set_defaults(fn=cmd_operator, action=name)


def _settings(args: argparse.Namespace, extra: list[str] | None = None):
    from ops.rollout.settings import RolloutSettings

    return RolloutSettings.load(args.config, [*args.overrides, *(extra or [])])


def _engine(settings):
    from feedback import db

    engine = db.make_engine(settings.database_url, echo=settings.database.echo)
    db.upgrade(engine)
    return engine


def _by() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no user name in this container
        return "cli"


def _start_overrides(args: argparse.Namespace) -> list[str]:
    from feedback.core.config import parse_duration
    from ops.rollout.settings import parse_weights

    out = []
    try:
        if args.weights:
            out.append(f"rollout.weights={json.dumps(parse_weights(args.weights))}")
        if args.interval:
            out.append(f"rollout.interval_s={parse_duration(args.interval)}")
    except ValueError as e:
        raise UserError(str(e)) from None
    for flag, key in (("min_samples", "min_samples"), ("alpha", "alpha"), ("max_holds", "max_holds")):
        if getattr(args, flag) is not None:
            out.append(f"rollout.{key}={getattr(args, flag)}")
    for item in args.threshold:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"bad --threshold {item!r}: expected KEY=VALUE, e.g. accept_rate_drop=0.05")
        out.append(f"rollout.thresholds.{key.strip()}={value.strip()}")
    if args.promote_rule:
        out.append(f'rollout.promote_rule="{args.promote_rule}"')
    if args.all:
        out.append('rollout.mode="all"')
    return out


def cmd_start(args: argparse.Namespace) -> int:
    from feedback import db
    from ops.rollout.commands import start_rollout

    s = _settings(args, _start_overrides(args))
    engine = _engine(s)
    try:
        r = start_rollout(engine, args.version, section=s.rollout, force=args.force, stable=args.stable, by=_by())
    finally:
        engine.dispose()
    if r.state == db.PROMOTED:
        console.print(
            f"[green]rollout {r.id}[/]: version {r.candidate_version} is stable now (mode all, no canary)",
            soft_wrap=True,
        )
    else:
        console.print(
            f"[green]rollout {r.id}[/]: version {r.candidate_version} against stable {r.stable_version}, canary at {r.weight:g}% "
            f"(steps {', '.join(f'{w:g}' for w in r.weights)}; {r.interval_s:g}s each). `flywheel rollout run` drives it.",
            soft_wrap=True,
        )
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import threading

    from ops.rollout.controller import run_controller

    s = _settings(args, ["rollout.auto=true"] if args.auto else [])
    print_config(s, "flywheel rollout run")
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    logging.getLogger("kafka").setLevel(logging.ERROR)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    engine = _engine(s)  # migrate once, and say so now if the database is unreachable
    try:
        progress = lambda m: console.print(m, markup=False, soft_wrap=True)  # noqa: E731
        run_controller(s, threading.Event(), engine=engine, handle_signals=True, progress=progress)
    finally:
        engine.dispose()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ops.rollout import rows

    s = _settings(args)
    engine = _engine(s)
    try:
        st = rows.status(engine, rollout_id=args.id, limit=args.steps)
    finally:
        engine.dispose()
    if args.json:
        sys.stdout.write(json.dumps(st.as_dict(), indent=2) + "\n")
        return 0
    pools = st.routes
    console.print(
        f"serving: stable v{pools.stable if pools.stable is not None else '? (as deployed)'}"
        + (f", canary v{pools.canary} at {pools.canary_percent:g}%" if pools.canary is not None else ", no canary")
    )
    r = st.rollout
    if r is None:
        console.print("no rollouts yet")
        return 0
    console.print(
        f"rollout {r.id}: v{r.candidate_version} against v{r.stable_version}, [bold]{r.state}[/], step {r.step_index + 1}/{len(r.weights)} "
        f"at {r.weight:g}%; {r.reason or ''}",
        soft_wrap=True,
    )
    if st.steps:
        from rich.table import Table

        t = Table("decided (UTC)", "step", "weight", "decision", "why")
        for step in st.steps:
            when = step.decided_at.strftime("%Y-%m-%d %H:%M:%S")
            t.add_row(
                when, str(step.step_index + 1), f"{step.weight:g}%", step.decision, str(step.evidence.get("reason", ""))
            )
        console.print(t)
    return 0


def cmd_operator(args: argparse.Namespace) -> int:
    from ops.rollout import commands

    s = _settings(args)
    engine = _engine(s)
    try:
        r = getattr(commands, args.action)(engine, args.id, by=_by(), reason=args.reason)
    finally:
        engine.dispose()
    console.print(f"rollout {r.id} (v{r.candidate_version}): [bold]{r.state}[/]")
    return 0
