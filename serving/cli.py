"""`flywheel` commands of the serving package (registered by ops/cli.py; heavy imports stay inside the commands)."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from ops.console import add_config_args, console, print_config, progress_line
from ops.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    """Add this package's commands to the `flywheel` parser."""
    p = sub.add_parser("serve", help="run the completion API (Ray Serve + vLLM)", description="run the completion API (Ray Serve + vLLM)")
    add_config_args(p)
    p.set_defaults(fn=cmd_serve)


def load_settings(args: argparse.Namespace):
    from serving.settings import ServingSettings

    return ServingSettings.load(args.config, args.overrides)


def check_ready(s) -> Path:
    """Refuse to start without editor tokens or a model, or on a busy port: one line each."""
    from ops.kafka_broker import port_free

    try:
        tokens = s.serve.editor_tokens()
    except ValueError as e:
        raise UserError(str(e)) from None
    if not tokens and not s.serve.allow_anonymous:
        raise UserError(
            "no editor tokens configured: set serve.auth_tokens_file (one token per line) or "
            "FLYWHEEL_SERVE__AUTH_TOKENS='[\"...\"]' (or serve.allow_anonymous=true for local development)"
        )
    model_dir = s.serve.model_dir
    if model_dir is None:
        raise UserError("no model to serve: set serve.model_dir to an exported model folder (`flywheel pretrain` makes one)")
    if not (Path(model_dir) / "config.json").is_file():
        raise UserError(f"serve.model_dir {model_dir} is not an exported model folder (no config.json)")
    if not port_free(s.serve.host, s.serve.port):
        raise UserError(f"port {s.serve.port} on {s.serve.host} is already in use; choose another with --set serve.port=...")
    return Path(model_dir)


def cmd_serve(args: argparse.Namespace) -> int:
    s = load_settings(args)
    model_dir = check_ready(s)
    print_config(s, "flywheel serve")
    from serving import app

    update, status = progress_line()
    with status:
        url = app.start(s, model_dir, s.serve.model_version, update)
    console.print(f"[green]serving[/] model v{s.serve.model_version} at {url}/v1/completions (health: {url}/v1/health, metrics: {url}/metrics)")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    console.print("shutting down")
    app.stop()
    return 0
