"""`flywheel` commands of the learner package (registered by ops/cli.py; heavy imports stay inside the commands)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add this package's commands to the `flywheel` parser."""
