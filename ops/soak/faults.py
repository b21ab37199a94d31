"""The faults the soak injects into a running loop, one at a time.

Each fault is a function of the running `Loop` that does its damage, waits (bounded by
`soak.fault_timeout_s`) until the loop has what it needs to go on, and returns a `Fault`: what
it did and what came back, with times, or why it could not be done.

    broker         the local Kafka broker stopped (SIGTERM) for `broker_down_s`, then started
    sink           `flywheel sink` SIGKILLed mid-stream, then started again
    postgres       the throwaway PostgreSQL server crashed (pg_ctl -m immediate) for
                   `postgres_down_s`, then started (WAL recovery); skipped on SQLite
    replica        a stable-pool replica's Ray actor killed; Ray Serve starts another
    learner        `flywheel learn` SIGKILLed while it holds the weight store's publish lock
                   (writing a version, or cleaning up after one), then started again
    corrupt_delta  a version published next to the learner's, its payload damaged after STABLE,
                   and a rollout pointing the canary at it: the replicas must refuse it
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.engine import Engine

from feedback import bus, db
from feedback.core.errors import first_line
from learner.store import Store
from ops import kafka_broker
from ops.soak.children import Child
from ops.soak.postgres import ThrowawayPostgres
from ops.soak.settings import SoakSettings

DONE, SKIPPED, FAILED = "done", "skipped", "failed"


@dataclass
class Fault:
    kind: str
    started: float  # time.time()
    ended: float
    outcome: str  # DONE | SKIPPED | FAILED
    detail: str  # what happened, or why it was skipped or failed
    expect_503_until: float | None = None  # a replica restart: 503s until then are its own


@dataclass
class Loop:
    """The running loop, as the faults reach it."""

    s: SoakSettings  # the run's settings (its own folder, ports and database)
    engine: Engine
    store: Store
    sink: Child
    learner: Child
    postgres: ThrowawayPostgres | None
    say: Callable[[str], None]
    damaged: set[int] = field(default_factory=set)  # versions the soak damaged on purpose


class NotNow(Exception):
    """The fault could not be injected or the loop did not recover in time; the message says which."""


def inject(kind: str, loop: Loop) -> Fault:
    """Run one fault; an error inside it is the fault's failure, never the soak's end."""
    started = time.time()
    try:
        outcome, detail, until = FAULTS[kind](loop)
    except NotNow as e:
        outcome, detail, until = FAILED, str(e), None
    except Exception as e:
        outcome, detail, until = FAILED, first_line(e), None
    return Fault(kind, started, time.time(), outcome, detail, until)


def _wait(condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.5):
    """`condition()`'s first truthy value, checked every `poll_s`; NotNow after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise NotNow(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(poll_s)


# --- the faults -------------------------------------------------------------------------------------


def broker(loop: Loop):
    s = loop.s
    pid = kafka_broker.stop(s)
    if pid is None:
        raise NotNow("no broker of the soak's was running")
    time.sleep(s.soak.broker_down_s)
    t0 = time.monotonic()
    kafka_broker.start(s, progress=lambda _: None)
    # The soak's bound, not kafka.start_timeout_s: a JVM starting on a loaded machine can take minutes.
    bus.wait_until_ready(s.kafka, s.soak.fault_timeout_s)
    return (
        DONE,
        f"broker pid {pid} stopped (SIGTERM) for {s.soak.broker_down_s:g} s; answering again {time.monotonic() - t0:.0f} s after its start",
        None,
    )


def sink(loop: Loop):
    pid = loop.sink.kill()
    return (
        DONE,
        f"pid {pid} SIGKILLed mid-stream (its batch in hand uncommitted); started again as pid {loop.sink.pid}",
        None,
    )


def postgres(loop: Loop):
    if loop.postgres is None:
        return SKIPPED, "the database is SQLite: there is no server to restart (soak.database = postgresql)", None
    took = loop.postgres.restart(loop.s.soak.postgres_down_s)
    return (
        DONE,
        f"server crashed (pg_ctl stop -m immediate: every connection cut) and down {loop.s.soak.postgres_down_s:g} s; "
        f"recovered from its WAL and accepting connections {took:.0f} s after its start",
        None,
    )


def replica(loop: Loop):
    import ray
    from ray import serve

    from feedback.pools import STABLE
    from serving.app import APP_NAME, deployment_name

    name = deployment_name(STABLE)
    prefix = f"SERVE_REPLICA::{APP_NAME}#{name}#"

    def replicas() -> set[str]:
        return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}

    def running() -> int:
        d = serve.status().applications[APP_NAME].deployments[name]
        return sum(n for state, n in d.replica_states.items() if str(getattr(state, "value", state)) == "RUNNING")

    wanted = loop.s.serve.replicas
    before = replicas()
    if not before:
        raise NotNow(f"no {name} replica found to kill")
    victim = sorted(before)[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    killed_at = time.monotonic()
    _wait(
        lambda: victim not in replicas() and len(replicas()) >= wanted and running() >= wanted,
        loop.s.soak.fault_timeout_s,
        f"a new {name} replica running",
        poll_s=1.0,
    )
    back = time.time()
    new = ", ".join(sorted(n.rsplit("#", 1)[1] for n in replicas() - before)) or "?"
    return (
        DONE,
        f"replica {victim.rsplit('#', 1)[1]} killed (ray.kill); Ray Serve started {new}, running {time.monotonic() - killed_at:.0f} s later",
        back + loop.s.soak.restart_grace_s,
    )


def learner(loop: Loop):
    """SIGKILL the learner while it holds the store's publish lock, so it dies inside a publish."""
    store, child = loop.store, loop.learner
    deadline = time.monotonic() + loop.s.soak.fault_timeout_s
    while True:
        holder = store.publishing()
        if holder is not None and holder.startswith(f"pid {child.pid} "):
            break
        if time.monotonic() >= deadline:
            raise NotNow(f"the learner did not publish within {loop.s.soak.fault_timeout_s:.0f} s")
        time.sleep(0.01)  # a tiny model's publish holds the lock for tens of milliseconds
    writing = sorted(store.unfinished())
    stable = store.versions()
    pid = child.kill()
    doing = f"writing {writing[0].split('/')[0]}" if writing else "its version written: recording it or cleaning up"
    return (
        DONE,
        f"pid {pid} SIGKILLed while it held the store's publish lock ({doing}; stable up to v{stable[-1]}); "
        f"started again as pid {child.pid}",
        None,
    )


def corrupt_delta(loop: Loop):
    """Publish a version beside the learner's, damage its payload after STABLE, and roll it out."""
    from learner.store import record
    from ops.rollout import commands
    from ops.rollout.rows import RolloutError, active

    store, engine, s = loop.store, loop.engine, loop.s
    parent = max(v for v in store.versions() if v not in loop.damaged)
    packed = dict(store.materialize(parent))
    name = "model.norm.weight"  # a small dense tensor: the candidate differs from its parent
    packed[name] = packed[name] * 1.0078125
    v = store.publish(packed, parent=parent).version
    loop.damaged.add(v)
    damaged = []
    for info in store.manifest(v)["files"].values():
        path = Path(store.root) / f"v{v:06d}" / info["name"]
        with open(path, "r+b") as f:  # one bit in the middle: the file's sha256 no longer matches
            f.seek(info["size"] // 2)
            byte = f.read(1)
            f.seek(info["size"] // 2)
            f.write(bytes([byte[0] ^ 0x01]))
        damaged.append(info["name"])
    record(
        store.model_version(
            v, gate_passed=True, gate_reason="planted by flywheel soak: its payload damaged after STABLE", metrics={}
        ),
        engine,
    )

    def started():
        with engine.connect() as conn:
            busy = active(conn)
        try:
            if busy is not None:  # an operator cuts the running rollout short
                commands.abort(engine, busy.id, by="soak", reason="the soak rolls out a damaged version")
            return commands.start_rollout(engine, v, section=s.rollout, by="soak")
        except RolloutError:
            return None  # the controller started another meanwhile: again

    rollout = _wait(started, s.soak.fault_timeout_s, f"a rollout of v{v}", poll_s=0.2)
    attempts = _wait(
        lambda: _swaps_to(engine, v), s.soak.fault_timeout_s, f"a canary replica's attempt at v{v}", poll_s=0.5
    )
    try:
        commands.abort(engine, rollout.id, by="soak", reason=f"v{v} was refused by the replicas, as it must be")
    except RolloutError:
        pass  # the controller ended it already
    refused = [a for a in attempts if not a.ok]
    outcome = DONE if len(refused) == len(attempts) else FAILED
    why = (refused[0].error or "").strip().split("\n")[0] if refused else ""  # the replica's own words
    return (
        outcome,
        f"v{v} published (a copy of v{parent}), then {', '.join(damaged)} damaged; rollout #{rollout.id} pointed the canary "
        f"at it: {len(refused)} of {len(attempts)} swap attempt(s) refused ({why[:160]})",
        None,
    )


def _swaps_to(engine: Engine, version: int) -> list:
    with engine.connect() as conn:
        e = db.swap_events.c
        return conn.execute(select(e.ok, e.error).where(e.to_version == version)).all()


FAULTS: dict[str, Callable[[Loop], tuple[str, str, float | None]]] = {
    "broker": broker,
    "sink": sink,
    "postgres": postgres,
    "replica": replica,
    "learner": learner,
    "corrupt_delta": corrupt_delta,
}
