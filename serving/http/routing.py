"""Which pool serves a user, and the poll that keeps the ingress's view of the pools current.

`poll_routing` reads the target state (feedback/pools.py) every `serve.pool_poll_s` and asks
each pool which version it serves. A user goes to the canary (sticky by user hash,
serving/routing.py) only while a canary is set with a share above 0 AND the canary pool
already reports that version; otherwise, and while it swaps, to stable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from feedback.core.errors import first_line
from feedback.pools import CANARY, POOLS, STABLE, Routes
from serving.routing import bucket

log = logging.getLogger(__name__)


class VersionReporter(Protocol):
    """What routing asks of a replica pool (serving.http.deps.ReplicaClient has it)."""

    async def served_version(self) -> int: ...


@dataclass
class RoutingState:
    """What the ingress knows of the pools: the targets in SQL and the version each pool
    reported at the last poll (None: not known, or the pool did not answer).

    A pool of several replicas answers `version` from one of them, so while a pool swaps it
    may report the new version before a sibling has it; a user routed there then may get the
    old version for a moment. That is harmless: each completion is tagged with the version
    that really produced it (GenerateResult.model_version), and so is its record."""

    routes: Routes = field(default_factory=Routes)
    serving: dict[str, int | None] = field(default_factory=dict)
    checked_at: float | None = None  # wall time of the last poll
    error: str | None = None  # the last poll's database error; the routes read before it stay

    @property
    def canary_live(self) -> bool:
        """Whether users go to the canary: it has a version and a share, and already serves it."""
        r = self.routes
        return r.canary is not None and r.canary_percent > 0 and self.serving.get(CANARY) == r.canary

    def pick(self, uhash: str) -> str:
        """The pool for this user: the canary for the users whose bucket is below its share, once live."""
        return CANARY if self.canary_live and bucket(uhash) < self.routes.canary_percent else STABLE

    def pool_serving(self, version: int) -> str | None:
        """A pool that serves `version` now (stable first)."""
        return next((p for p in POOLS if self.serving.get(p) == version), None)

    @property
    def versions(self) -> list[int]:
        return sorted({v for v in self.serving.values() if v is not None})


class Routed(Protocol):
    """What routing reads and updates of the API's state (serving.http.deps.ApiState)."""

    routing: RoutingState
    replicas: Mapping[str, VersionReporter]


async def refresh_routing(st: Routed, read_routes: Callable[[], Routes], *, timeout_s: float = 10.0) -> None:
    """One poll: the targets (`read_routes`, blocking, so in a thread), then each pool's version."""
    rt = st.routing
    try:
        rt.routes = await asyncio.to_thread(read_routes)
        if rt.error is not None:
            log.info("serving targets readable again")
        rt.error = None
    except Exception as e:  # keep routing as it stood: a database blip must not move users
        msg = f"reading the serving targets (serving_pools) failed: {first_line(e)}"
        if msg != rt.error:
            log.error("%s (is the database migrated? `flywheel db upgrade`); routing as before", msg)
        rt.error = msg

    async def ask(pool: str, client: VersionReporter) -> None:
        try:
            rt.serving[pool] = await asyncio.wait_for(client.served_version(), timeout_s)
        except Exception as e:  # a pool that does not answer gets no canary users and no pinned ones
            if rt.serving.get(pool) is not None:
                log.warning("the %s pool did not report its version: %s: %s", pool, type(e).__name__, e)
            rt.serving[pool] = None

    await asyncio.gather(*(ask(p, c) for p, c in st.replicas.items()))
    rt.checked_at = time.time()


async def poll_routing(st: Routed, read_routes: Callable[[], Routes], interval_s: float) -> None:
    """`refresh_routing` every `interval_s`, forever (the ingress runs it as a background task)."""
    while True:
        try:
            await refresh_routing(st, read_routes)
        except Exception:
            log.exception("refreshing the routing state failed")
        await asyncio.sleep(interval_s)
