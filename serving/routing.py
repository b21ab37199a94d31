"""Which model version serves a user: sticky by a hash of the user id.

A user's bucket (0 <= b < 100) comes from a hash of their pseudonymous id, so it never
changes; the canary pool with traffic share w serves the buckets below w (serving/http/routing.py,
RoutingState.pick). Raising a canary's share from 5 to 25 keeps the first 5% of users on it
and adds the next 20%: nobody flips back and forth while a rollout advances.
"""

from __future__ import annotations

import hashlib


def user_hash(user: str | None, fallback: str) -> str:
    """A pseudonymous, stable id for the user (raw ids never leave the ingress)."""
    return hashlib.sha256((user or fallback).encode()).hexdigest()[:32]


def bucket(uhash: str) -> float:
    """[0, 100) with 0.01 resolution, uniform over users."""
    return int(hashlib.sha256(f"bucket:{uhash}".encode()).hexdigest()[:8], 16) % 10_000 / 100
