"""Kafka plumbing shared by serving, the sink and the learner: topics, admin, clients.

Every client here talks to whatever `kafka.bootstrap` names: the local broker that
`flywheel up` runs, or an existing cluster, with the same security options (TLS, SASL).

kafka-python retries a refused TLS handshake or SASL login until its bootstrap timeout and
then says only "Unable to bootstrap". So before it makes a client on a secured cluster,
`check_security` opens one connection with kafka-python's own connection code and turns a
refusal into one UserError line at once; an unreachable broker is left to the client.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from kafka.errors import (
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailedError,
    TopicAlreadyExistsError,
    UnsupportedSaslMechanismError,
)

from feedback.core.config import KafkaSettings, TopicSettings
from feedback.core.errors import UserError

COMPLETIONS = "flywheel.completions"
EVENTS = "flywheel.events"
VERSIONS = "flywheel.versions"


def topic_specs(k: KafkaSettings) -> dict[str, TopicSettings]:
    return {COMPLETIONS: k.completions, EVENTS: k.events, VERSIONS: k.versions}


class _CheckIsQuiet(logging.Filter):
    """Drops kafka-python's own log lines about `check_security`'s connection: its refusal is
    raised as one line, and a CLI must not print three more before it. The check drives its
    connection on the calling thread, so the thread says which lines are the check's."""

    active = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(self.active, "on", False)


_QUIET = _CheckIsQuiet()
for _name in ("kafka.net.manager", "kafka.net.connection", "kafka.net.transport", "kafka.protocol.parser"):
    logging.getLogger(_name).addFilter(_QUIET)


class KafkaRefused(UserError):
    """A broker answered but refused this client: its TLS handshake or its SASL login."""

    @property
    def kind(self) -> str:
        """The refusal without the broker's own reason, which varies between tries of one refusal
        (a SASL broker answers a wrong password with an error on one try and just closes the
        connection on the next): what a retrying client logs once."""
        text = str(self)
        before, found, _ = text.partition(SASL_REFUSED)
        return before + found if found else text


def security_options(k: KafkaSettings) -> dict[str, Any]:
    """The security options every client gets, in kafka-python's names."""
    opts: dict[str, Any] = {"security_protocol": k.security_protocol}
    if k.uses_tls:
        if k.ssl_cafile is None and not k.ssl_system_trust:
            # KafkaSettings refuses this; only a hand-built local sasl_ssl section gets here.
            raise UserError("kafka.ssl_cafile is unset: name the CA that signed the brokers' certificates")
        if k.ssl_cafile is not None and not k.ssl_cafile.is_file():
            raise UserError(
                f"kafka.ssl_cafile {k.ssl_cafile} does not exist"
                + ("; `flywheel up` writes it for the local sasl_ssl broker" if k.local_listener == "sasl_ssl" else "")
            )
        opts.update(
            ssl_cafile=str(k.ssl_cafile) if k.ssl_cafile else None,  # None: the system's CA store
            ssl_certfile=str(k.ssl_certfile) if k.ssl_certfile else None,
            ssl_keyfile=str(k.ssl_keyfile) if k.ssl_keyfile else None,
            ssl_password=k.ssl_key_password.get_secret_value() if k.ssl_key_password else None,
            ssl_check_hostname=k.ssl_check_hostname,
        )
    if k.uses_sasl:
        assert k.sasl_password is not None  # KafkaSettings requires it with SASL
        opts.update(
            sasl_mechanism=k.sasl_mechanism,
            sasl_plain_username=k.sasl_username,
            sasl_plain_password=k.sasl_password.get_secret_value(),
        )
    return opts


# How a refused SASL login reads, whatever reason the broker gave (KafkaRefused.kind).
SASL_REFUSED = "refused the SASL login"


def refusal(k: KafkaSettings, server: str, error: BaseException, *, in_login: bool = False) -> str | None:
    """What a refused connection to `server` means for the user, in one line; None when the
    error says only that the broker is unreachable (down, wrong port, still starting).
    `in_login`: the broker had answered ApiVersions, so the SASL login was under way."""
    check = "check kafka.sasl_username, kafka.sasl_password (FLYWHEEL_KAFKA__SASL_PASSWORD) and kafka.sasl_mechanism"
    if isinstance(error, SaslAuthenticationFailedError):
        reason = str(error).rpartition("SaslAuthenticationFailedError: ")[2] or "authentication failed"
        return f"Kafka at {server} {SASL_REFUSED} for user {k.sasl_username} ({k.sasl_mechanism}): {reason}; {check}"
    if in_login and k.uses_sasl and isinstance(error, KafkaConnectionError) and "Handshake failed" not in str(error):
        # A broker closes the connection right after its "authentication failed" answer, and
        # kafka-python sometimes reads the close before the answer: the login was refused all the same.
        return (
            f"Kafka at {server} {SASL_REFUSED} for user {k.sasl_username} ({k.sasl_mechanism}): "
            f"it closed the connection during the login; {check}"
        )
    if isinstance(error, UnsupportedSaslMechanismError):
        offered = str(error).partition("Enabled mechanisms: ")[2]
        return (
            f"Kafka at {server} does not offer the SASL mechanism {k.sasl_mechanism}"
            + (f" (it offers {offered})" if offered else "")
            + ": set kafka.sasl_mechanism to one it enables"
        )
    text = str(error)
    if isinstance(error, KafkaConnectionError) and "Handshake failed: " in text:
        reason = text.partition("Handshake failed: ")[2]
        if "CERTIFICATE_VERIFY_FAILED" in reason and "match" in reason.lower():
            hint = "the broker's certificate does not name the host dialed; connect by a name it holds"
        elif "CERTIFICATE_VERIFY_FAILED" in reason:
            trusted = f"kafka.ssl_cafile ({k.ssl_cafile})" if k.ssl_cafile else "the system's CA store"
            hint = f"{trusted} did not sign the broker's certificate; set kafka.ssl_cafile to the CA that did"
        else:
            hint = "does the broker listen with TLS on this port, and accept this client?"
        return f"Kafka at {server}: TLS handshake failed: {reason}; {hint}"
    if isinstance(error, ssl.SSLError | FileNotFoundError | PermissionError | IsADirectoryError):
        # Raised while kafka-python builds its TLS context from the files, before any network I/O
        # (a handshake's own errors come wrapped in KafkaConnectionError, above).
        return f"Kafka client TLS setup failed before connecting to {server}: {type(error).__name__}: {text}"
    return None


def check_security(k: KafkaSettings, timeout_s: float = 10.0) -> None:
    """Raise KafkaRefused if the first bootstrap server that answers refuses the TLS handshake or
    the SASL login; return if one accepts, or if none answers (the client then reports that)."""
    if k.security_protocol == "PLAINTEXT":
        return
    # kafka-python's own connection code (pinned version; `kafka.net` exports both), so the check
    # makes the same TLS context, handshake and login as the clients do.
    from kafka.net import KafkaConnectionManager, NetworkSelector

    opts = security_options(k) | {"bootstrap_servers": k.bootstrap, "client_id": "flywheel-check"}
    timeout_ms = int(timeout_s * 1000)
    net = NetworkSelector(**opts)
    manager = KafkaConnectionManager(net, **opts)

    async def first_answer() -> str | None:
        for broker in manager.cluster.bootstrap_brokers():
            conn = manager.get_connection(
                broker.node_id, timeout_ms=timeout_ms, pop_on_close=False, refresh_metadata_on_err=False
            )
            try:
                await manager.wait_for(conn.init_future, timeout_ms)
                return None  # accepted
            except Exception as e:
                in_login = conn.broker_version_data is not None  # set once ApiVersions was answered
                if why := refusal(k, f"{broker.host}:{broker.port}", e, in_login=in_login):
                    return why
        return None

    _QUIET.active.on = True
    try:
        refused = manager.run(first_answer)
    finally:
        manager.close()
        net.close()
        _QUIET.active.on = False
    if refused is not None:
        raise KafkaRefused(refused)


def admin(k: KafkaSettings, timeout_s: float | None = None) -> KafkaAdminClient:
    """An admin client, or UserError naming the unreachable servers (or why they refused it)."""
    timeout_s = timeout_s or k.request_timeout_ms / 1000
    check_security(k, timeout_s)
    try:
        return KafkaAdminClient(
            bootstrap_servers=k.bootstrap,
            client_id="flywheel-admin",
            request_timeout_ms=k.request_timeout_ms,
            bootstrap_timeout_ms=int(timeout_s * 1000),
            **security_options(k),
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
        except KafkaRefused:
            raise  # waiting does not change a password or a certificate
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


# How often a consumer refreshes its cluster metadata: a topic's new partitions, or a lost refresh
# that left a member without its partitions, are seen within this.
METADATA_MAX_AGE_MS = 30_000


def producer(k: KafkaSettings, **overrides) -> KafkaProducer:
    """A durable producer: a send counts once every in-sync replica has it, and it retries.
    KafkaRefused if the cluster refuses its TLS handshake or login."""
    check_security(k, k.request_timeout_ms / 1000)
    opts = dict(
        **security_options(k),
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
    """A consumer-group member that commits offsets only when told (after its own work is durable).
    KafkaRefused if the cluster refuses its TLS handshake or login.

    The partitions of `topics` are looked up before the member first joins its group. Without
    them the group's leader assigns nothing ("No partition metadata for topic") and only a later
    metadata refresh starts the rebalance that hands the partitions out. When that refresh was
    lost, a sink in CI held no partitions for minutes while its topics filled. A refresh every
    `METADATA_MAX_AGE_MS` (Kafka's default is 5 minutes) bounds such a wait too.
    """
    check_security(k, k.request_timeout_ms / 1000)
    opts = dict(
        **security_options(k),
        bootstrap_servers=k.bootstrap,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        request_timeout_ms=max(k.request_timeout_ms, 30_000),
        metadata_max_age_ms=METADATA_MAX_AGE_MS,
    )
    opts.update(overrides)
    if "session_timeout_ms" in overrides and "heartbeat_interval_ms" not in overrides:
        # Kafka's rule of thumb: three heartbeats per session, so one lost heartbeat is no eviction
        opts["heartbeat_interval_ms"] = max(100, overrides["session_timeout_ms"] // 3)
    c = KafkaConsumer(*topics, **opts)
    for topic in topics:
        c.partitions_for_topic(topic)
    return c
