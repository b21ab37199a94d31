"""The serving pools follow the rollout: write what its state asks for, and repair a failed write.

A decision is committed before the pools are written, so a database that refuses the second
write leaves the rollout ahead of the pools; every controller pass (`reconcile`) compares
them with the latest rollout and writes them again.
"""

from __future__ import annotations

import logging
import math

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from feedback import db, pools
from feedback.db import PROMOTED
from ops.rollout.rows import Rollout, RolloutError

log = logging.getLogger("flywheel.rollout")


def apply_pools(engine: Engine, r: Rollout) -> None:
    """Write the serving topology the rollout's state asks for; RolloutError (503) if the database
    refuses (the decision itself is committed: the controller repairs the pools when it answers)."""
    try:
        if r.active:
            pools.set_canary(engine, r.candidate_version, r.weight, rollout_id=r.id)
        elif r.state == PROMOTED:
            pools.set_stable(engine, r.candidate_version, rollout_id=r.id)
        else:
            pools.clear_canary(engine, rollout_id=r.id)
    except SQLAlchemyError as e:
        raise RolloutError(
            f"rollout {r.id} is {r.state}, but serving_pools could not be written ({type(e).__name__}); "
            "the controller (flywheel rollout run) applies it when the database answers",
            status=503,
            code="pools_unwritten",
        ) from None


def reconcile(engine: Engine, r: Rollout) -> bool:
    """Repair the serving pools if they disagree with rollout `r` (the latest); True if it wrote.

    An active rollout owns the canary pool. A finished one is repaired only while the pools
    still carry its id: once `flywheel swap` or another rollout wrote them, they are theirs.
    """
    with engine.connect() as conn:
        rows = {row.pool: row for row in conn.execute(select(db.serving_pools))}
    stable, canary = rows.get(pools.STABLE), rows.get(pools.CANARY)
    if r.active:
        ok = (
            canary is not None
            and canary.version == r.candidate_version
            and math.isclose(canary.traffic_percent, r.weight)
        )
    else:
        owned = not rows or any(row.rollout_id == r.id for row in rows.values())
        if not owned:
            return False
        canary_off = canary is None or canary.version is None
        ok = canary_off and (r.state != PROMOTED or (stable is not None and stable.version == r.candidate_version))
    if ok:
        return False
    log.warning("rollout %d (%s): serving_pools disagree; rewriting them", r.id, r.state)
    apply_pools(engine, r)
    return True
