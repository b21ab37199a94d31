"""Kafka plumbing shared by serving, the sink and the learner: topics, admin, clients.

Every client here talks to whatever `kafka.bootstrap` names: the local broker that
`flywheel up` runs, or an existing cluster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from feedback.core.config import KafkaSettings, TopicSettings
from feedback.core.errors import UserError

COMPLETIONS = "flywheel.completions"
EVENTS = "flywheel.events"
VERSIONS = "flywheel.versions"


def topic_specs(k: KafkaSettings) -> dict[str, TopicSettings]:
    return {COMPLETIONS: k.completions, EVENTS: k.events, VERSIONS: k.versions}


def admin(k: KafkaSettings, timeout_s: float | None = None) -> KafkaAdminClient:
    """An admin client, or UserError naming the unreachable servers."""
    try:
        return KafkaAdminClient(
            bootstrap_servers=k.bootstrap,
            client_id="flywheel-admin",
            request_timeout_ms=k.request_timeout_ms,
            bootstrap_timeout_ms=int((timeout_s or k.request_timeout_ms / 1000) * 1000),
        )
    except (KafkaError, OSError) as e:
        raise UserError(
            f"Kafka at {k.bootstrap} is unreachable ({type(e).__name__}); is `flywheel up` running?"
        ) from None


def wait_until_ready(k: KafkaSettings, timeout_s: float, alive=lambda: None) -> None:
    """Block until the cluster answers a metadata request. `alive()` may raise to stop early."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive()
        try:
            client = admin(k, timeout_s=2.0)
            try:
                client.describe_cluster()
                return
            finally:
                client.close()
        except (UserError, KafkaError, OSError):
            time.sleep(0.5)
    raise UserError(f"Kafka at {k.bootstrap} did not answer within {timeout_s:.0f}s; is it running and reachable?")


def ensure_topics(k: KafkaSettings) -> list[str]:
    """Create Flywheel's topics with their partition counts and retention; return the new ones."""
    client = admin(k)
    try:
        existing = set(client.list_topics())
        wanted = [
            NewTopic(
                name,
                num_partitions=spec.partitions,
                replication_factor=1 if k.managed else -1,  # -1: the cluster's default
                topic_configs={"retention.ms": str(spec.retention_ms), "cleanup.policy": spec.cleanup_policy},
            )
            for name, spec in topic_specs(k).items()
            if name not in existing
        ]
        if wanted:
            try:
                client.create_topics(wanted, timeout_ms=k.request_timeout_ms)
            except TopicAlreadyExistsError:
                pass  # another process created them between list and create
        return [t.name for t in wanted]
    finally:
        client.close()


@dataclass(frozen=True)
class TopicInfo:
    name: str
    partitions: int
    retention_ms: str
    cleanup_policy: str


def describe_topics(k: KafkaSettings) -> list[TopicInfo]:
    from kafka.admin import ConfigResource, ConfigResourceType

    client = admin(k)
    try:
        names = sorted(t for t in client.list_topics() if not t.startswith("__"))
        if not names:
            return []
        partitions = {t["name"]: len(t["partitions"]) for t in client.describe_topics(names)}
        described = client.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, n) for n in names], config_filter="all"
        )
        configs = {
            name: {key: d.get("value") for key, d in entries.items()}
            for name, entries in next(iter(described.values()), {}).items()
        }
        return [
            TopicInfo(
                n,
                partitions.get(n, 0),
                configs.get(n, {}).get("retention.ms", "?"),
                configs.get(n, {}).get("cleanup.policy", "?"),
            )
            for n in names
        ]
    finally:
        client.close()


def producer(k: KafkaSettings, **overrides) -> KafkaProducer:
    """A durable producer: a send counts once every in-sync replica has it, and it retries."""
    opts = dict(
        bootstrap_servers=k.bootstrap,
        client_id="flywheel",
        acks="all",
        retries=5,
        linger_ms=k.producer_linger_ms,
        batch_size=k.producer_batch_bytes,
        request_timeout_ms=k.request_timeout_ms,
    )
    opts.update(overrides)
    return KafkaProducer(**opts)


def consumer(k: KafkaSettings, *topics: str, group_id: str, **overrides) -> KafkaConsumer:
    """A consumer-group member that commits offsets only when told (after its own work is durable)."""
    opts = dict(
        bootstrap_servers=k.bootstrap,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        request_timeout_ms=max(k.request_timeout_ms, 30_000),
    )
    opts.update(overrides)
    return KafkaConsumer(*topics, **opts)
