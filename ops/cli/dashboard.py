"""`flywheel dashboard --out PATH`: a static, offline copy of the ops dashboard (registered by ops/cli/main.py)."""

from __future__ import annotations

import argparse

from feedback.core.errors import UserError
from ops.cli.console import add_config_args, console


def register(sub: argparse._SubParsersAction) -> None:
    """Add `flywheel dashboard` to the `flywheel` parser."""
    p = sub.add_parser(
        "dashboard",
        help="write the ops dashboard as one self-contained HTML file",
        description="Read the database and write the ops dashboard (accept rate and reward per version, the rollout, "
        "delta sizes, swap pauses, feedback volume) as one HTML file that opens offline. "
        "The live page is GET /ops/dashboard on the API (ops token).",
    )
    p.add_argument("--out", metavar="PATH", required=True, help="the HTML file to write, e.g. dashboard.html")
    add_config_args(p)
    p.set_defaults(fn=cmd_dashboard)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sqlalchemy.engine import make_url

    from feedback import db
    from feedback.core.config import StackSettings
    from ops.dashboard import write_static

    s = StackSettings.load(args.config, args.overrides)
    url = make_url(s.database_url)
    if url.get_backend_name() == "sqlite" and not (url.database and Path(url.database).expanduser().is_file()):
        raise UserError(
            f"database {url.database or ':memory:'} does not exist; run `flywheel up` (or `flywheel db upgrade`) first"
        )
    engine = db.make_engine(s.database_url)
    try:
        revision, head = db.current_revision(engine), db.head_revision()
        if revision != head:
            raise UserError(
                f"database {url.render_as_string(hide_password=True)} is at revision {revision or 'none'}, "
                f"the dashboard needs {head}: run `flywheel db upgrade`"
            )
        try:
            out = write_static(engine, args.out)
        except OSError as e:
            raise UserError(f"cannot write {args.out}: {e.strerror}") from None
    finally:
        engine.dispose()
    console.print(f"[green]wrote[/] {out} ({out.stat().st_size / 1e6:.1f} MB, opens offline)")
    return 0
