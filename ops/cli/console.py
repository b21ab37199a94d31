"""Terminal output shared by every command: consoles, config printing, progress lines."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from rich.console import Console

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def add_config_args(p: argparse.ArgumentParser) -> None:
    """`--config FILE` and repeatable `--set KEY=VALUE`, which every command takes."""
    p.add_argument("--config", metavar="FILE", help="TOML config file (default: $FLYWHEEL_CONFIG or ./flywheel.toml)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a setting, e.g. kafka.port=9093",
    )


def print_config(settings: Any, title: str) -> None:
    """Each process prints its resolved config at start (flattened, secrets masked)."""

    def flat(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
        out = []
        for k, v in d.items():
            out += flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
        return out

    console.print(f"[bold]{title}[/] resolved config:")
    for k, v in flat(settings.redacted()):
        console.print(f"  [dim]{k}[/] = {v!r}", markup=True)


def progress_line() -> tuple[Callable[[str], None], Any]:
    status = console.status("")

    def update(msg: str) -> None:
        status.update(msg)
        if not console.is_terminal:
            console.print(f"  {msg}", markup=False)

    return update, status


def bench_subcommands(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The subcommands of `flywheel bench`, creating the `bench` command on first use."""
    bench = sub.choices.get("bench")
    if bench is None:
        bench = sub.add_parser(
            "bench", help="benchmarks, each against its baseline", description="Benchmarks, each against its baseline."
        )
        bench.set_defaults(
            bench_sub=bench.add_subparsers(
                dest="benchmark", required=True, metavar="BENCHMARK", parser_class=type(bench)
            )
        )
    return bench.get_default("bench_sub")
