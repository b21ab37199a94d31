"""Publishing a model version, in the one order every publisher follows:

    store.publish   the weights, visible only once complete (STABLE last; learner/store.py)
    record          its `model_versions` row: gate verdict and metrics (the rollout controller
                    and the dashboard read it)
    announce        its `flywheel.versions` message, last, so whoever hears of a version finds
                    it in the store and in SQL

and, after each publish, `cleanup` deletes old versions, but never one that serving needs: a
pool's target, the stable version, a version a replica serves, or one the caller names (the
learner's last good version), nor the delta chains back to a full snapshot those need. A
replica restarted from its model folder reaches its pool's target from the store alone, however
many versions were published since.

A publisher that dies between the steps leaves a version that is stored but not recorded or
announced; the learner finds it on restart and completes it with `packed=None` (recording
again is an upsert, announcing again is harmless: consumers skip versions they know). The
learner (learner/train/learn.py) and the demo's fault injection (ops/demo.py) publish through
`publish_version`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Protocol

from feedback import bus, pools
from feedback.core.clock import utcnow
from feedback.core.errors import first_line
from feedback.schemas import ModelVersion
from learner import delta as codec
from learner.store import Store, announce, record

log = logging.getLogger(__name__)


class Producer(Protocol):
    """feedback.producer.BufferedProducer, or anything that sends and flushes like it."""

    def send(self, topic: str, msg) -> object: ...

    def flush(self, timeout_s: float = ...) -> bool: ...


def publish_version(
    store: Store,
    packed: Mapping[str, codec.Entry] | None,
    *,
    parent: int | None,
    engine,
    producer: Producer,
    gate_passed: bool,
    gate_reason: str | None = None,
    metrics: Mapping[str, float] | None = None,
    version: int | None = None,
    show_policy: Mapping | None = None,
    flush_timeout_s: float = 30.0,
) -> ModelVersion:
    """Store `packed` as the next version (or as `version`), a delta against `parent`; record
    it in `model_versions` on `engine` with the gate's verdict and `metrics` ({name: number}),
    with `show_policy` (learner/show.py) in its manifest; announce it with `producer`. Returns the announced message.

    `packed` None: `version` is in the store already (published before the publisher stopped),
    and only its row and announcement are written. An announcement Kafka does not take within
    `flush_timeout_s` stays in the producer's buffer (a warning says so): the version is
    recorded, and the producer delivers it once Kafka is back."""
    if packed is not None:
        version = store.publish(packed, parent=parent, version=version, show_policy=show_policy).version
    elif version is None or version not in store.versions():
        raise ValueError(f"version {version} is not in the store {store.uri()}: pass its weights to publish it")
    gate = {"gate_passed": gate_passed, "gate_reason": gate_reason}
    if metrics is not None:
        gate["metrics"] = dict(metrics)
    msg = store.model_version(version, **gate)
    record(msg, engine)
    announce(msg, producer)
    if not producer.flush(timeout_s=flush_timeout_s):
        log.warning(
            "v%d is recorded in SQL but not yet on %s (Kafka unreachable); it stays buffered", version, bus.VERSIONS
        )
    return msg


def cleanup(store: Store, engine, *, keep: int, also: Iterable[int] = ()) -> list[int]:
    """Delete versions beyond the newest `keep` (`Store.cleanup`), keeping every version serving
    needs (`feedback.pools.versions_in_use`) and `also`, with their chains. When the database
    cannot say what serving needs, nothing is deleted: a full disk later beats a replica that can
    never reach its target. Returns the deleted versions."""
    try:
        with engine.connect() as conn:
            in_use = pools.versions_in_use(conn, now=utcnow())
    except Exception as e:  # the database is down or not migrated: keep everything this time
        log.warning("store cleanup skipped: cannot read the versions serving needs (%s)", first_line(e))
        return []
    return store.cleanup(keep, protect=in_use | set(also))
