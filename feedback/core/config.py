"""Typed configuration: one pydantic-settings class per process.

Sources, highest priority first:
  1. command-line overrides (`--set kafka.port=9093`, repeatable);
  2. environment variables `FLYWHEEL_*`, nested with `__` (`FLYWHEEL_KAFKA__PORT=9093`);
  3. a TOML file (`--config FILE`, or `FLYWHEEL_CONFIG`, or `./flywheel.toml` if present);
  4. the defaults below.

All processes read the same file; each takes the sections it needs and ignores the others.
Inside a section, unknown keys are errors, so a typo is caught instead of silently ignored.
`flywheel.example.toml` at the repository root documents every field.
"""

from __future__ import annotations

import contextvars
import os
import re
import ssl
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Self, get_args

import platformdirs
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretBytes,
    SecretStr,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from feedback.core.errors import UserError

_TOML_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("flywheel_toml_file", default=None)


_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(v: object) -> float:
    """Seconds from a number or a string like "3h", "90s", "1h30m", "2.5m", "250ms"; ValueError otherwise."""
    if isinstance(v, bool):
        raise ValueError(f"expected a duration like 3h, 90s or 1h30m (or seconds), got {v!r}")
    if isinstance(v, int | float):
        seconds = float(v)
    elif isinstance(v, str):
        text = v.strip().lower().replace(" ", "")
        parts = _DURATION_PART.findall(text)
        try:
            seconds = float(text)
        except ValueError:
            if not parts or "".join(n + u for n, u in parts) != text:
                raise ValueError(f"bad duration {v!r}: expected e.g. 3h, 90s, 1h30m or seconds") from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise ValueError(f"expected a duration like 3h, 90s or 1h30m (or seconds), got {v!r}")
    if not seconds > 0:
        raise ValueError(f"bad duration {v!r}: it must be positive")
    return seconds


Seconds = Annotated[float, BeforeValidator(parse_duration)]
"""A settings field in seconds that also accepts "3h", "90s", "1h30m"."""


def _empty_is_none(v: object) -> object:
    return None if v == "" else v


OptionalPath = Annotated[Path | None, BeforeValidator(_empty_is_none)]
"""A file setting where "" (an empty environment variable, say) means unset."""

LOCAL_BROKER_USER = "flywheel-broker"
"""The local sasl_ssl broker's own SCRAM user (its random password lives in its data folder)."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class TopicSettings(Section):
    """One Kafka topic as `flywheel up` creates it."""

    partitions: int = Field(ge=1, le=1024)
    """Partition count; the upper bound on consumer parallelism for this topic."""
    retention_ms: int = Field(ge=-1)
    """Kafka `retention.ms`; -1 keeps messages forever."""
    cleanup_policy: str = Field(default="delete", pattern="^(delete|compact|compact,delete)$")
    """Kafka `cleanup.policy`."""


class KafkaSettings(Section):
    bootstrap_servers: str = ""
    """Existing Kafka cluster (`host:port,...`). Empty: `flywheel up` starts a local broker."""
    host: str = "127.0.0.1"
    """Address the local broker listens on and advertises."""
    port: int = Field(default=9092, ge=1, le=65535)
    """Client port of the local broker."""
    controller_port: int = Field(default=9093, ge=1, le=65535)
    """KRaft controller port of the local broker."""
    heap: str = Field(default="512m", pattern=r"^\d+[mMgG]$")
    """JVM heap of the local broker (`-Xmx`)."""
    start_timeout_s: float = Field(default=90.0, gt=0)
    """How long `up` waits for the broker to answer."""
    request_timeout_ms: int = Field(default=10_000, ge=100)
    """Client timeout for admin and produce requests."""
    producer_buffer_bytes: int = Field(default=64 * 2**20, ge=1024)
    """Bytes of records (keys and values) a process holds in memory while Kafka is unreachable
    (serving's completion records and events, the learner's announcements); beyond, like beyond
    `serve.producer_buffer` records, new ones are dropped and counted."""
    producer_batch_bytes: int = Field(default=256 * 2**10, ge=1024, le=64 * 2**20)
    """Bytes a producer gathers per partition into one produce request. The client's 16 KiB
    default caps a burst of events at a few hundred per request, and each request is a round
    trip: 256 KiB delivered 2.6x the events/s of 16 KiB through the buffered producer."""
    producer_linger_ms: int = Field(default=5, ge=0, le=1000)
    """How long a producer waits for more records before sending a request that is not full:
    the latency one record may gain for fewer, larger requests."""
    completions: TopicSettings = TopicSettings(partitions=3, retention_ms=7 * 24 * 3600 * 1000)
    """Topic `flywheel.completions`: one record per served completion (key: completion_id)."""
    events: TopicSettings = TopicSettings(partitions=3, retention_ms=7 * 24 * 3600 * 1000)
    """Topic `flywheel.events`: editor feedback (key: completion_id, so a completion's events stay ordered)."""
    versions: TopicSettings = TopicSettings(partitions=1, retention_ms=-1, cleanup_policy="compact")
    """Topic `flywheel.versions`: model-version announcements (key: version), compacted and kept forever."""

    # --- security: every client Flywheel makes (feedback/bus.py) uses these ---------------------
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """How clients reach the brokers: PLAINTEXT (no TLS, no login: the local broker's default),
    SSL (TLS; with `ssl_certfile` also a client certificate: Strimzi's `tls` listeners), SASL_SSL
    (TLS and a login: Confluent Cloud, MSK), SASL_PLAINTEXT (a login without TLS: the password
    crosses the network readable, so only inside a trusted network). With `local_listener =
    "sasl_ssl"` it is SASL_SSL (and may be left out)."""
    ssl_cafile: OptionalPath = None
    """PEM file of the CA(s) that signed the brokers' certificates. TLS needs it, or
    `ssl_system_trust = true`. Unset with `local_listener = "sasl_ssl"`: the CA `flywheel up`
    generated, `<data_dir>/kafka/tls/ca.pem`."""
    ssl_system_trust: bool = False
    """Trust the system's CA store instead of `ssl_cafile` (brokers with publicly signed
    certificates: Confluent Cloud, MSK). Off by default, so that a TLS setting that names no CA
    is an error rather than a silent choice."""
    ssl_certfile: OptionalPath = None
    """Client certificate (PEM), for brokers that require mutual TLS; the key is in it or in `ssl_keyfile`."""
    ssl_keyfile: OptionalPath = None
    """Private key (PEM) of `ssl_certfile`, when it is a file of its own."""
    ssl_key_password: SecretStr | None = None
    """Password of an encrypted `ssl_keyfile` (`FLYWHEEL_KAFKA__SSL_KEY_PASSWORD`)."""
    ssl_check_hostname: bool = True
    """Check that a broker's certificate names the host the client dialed. Turn off only for
    brokers whose certificates lack their advertised names; the CA is checked either way."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    """SASL login mechanism: PLAIN (Confluent Cloud API keys; only over TLS), SCRAM-SHA-512 (MSK,
    Strimzi `scram-sha-512`, the local broker) or SCRAM-SHA-256."""
    sasl_username: str = ""
    """SASL user (Confluent Cloud: the API key)."""
    sasl_password: SecretStr | None = None
    """SASL password (Confluent Cloud: the API secret). Set it in the environment
    (`FLYWHEEL_KAFKA__SASL_PASSWORD`) or an owner-only config file, never in the repository."""
    local_listener: Literal["plaintext", "sasl_ssl"] = "plaintext"
    """The local broker's client listener. `sasl_ssl`: `flywheel up` generates a CA and a broker
    certificate for `host`, listens with TLS and SCRAM logins only (the controller port with
    mutual TLS), and sets the SCRAM credential of `sasl_username` / `sasl_password`;
    clients then use SASL_SSL with that CA."""

    @model_validator(mode="after")
    def _distinct_ports(self) -> Self:
        if not self.bootstrap_servers and self.port == self.controller_port:
            raise ValueError("kafka.port and kafka.controller_port must differ")
        return self

    @model_validator(mode="after")
    def _security_complete(self) -> Self:
        if self.local_listener == "sasl_ssl":
            _check_local_sasl_ssl(self)
        elif self.managed and self.security_protocol != "PLAINTEXT":
            raise ValueError(
                f"kafka.security_protocol = {self.security_protocol}, but the local broker `flywheel up` runs "
                f'listens with PLAINTEXT: set kafka.local_listener = "sasl_ssl", or kafka.bootstrap_servers '
                f"to the cluster that speaks {self.security_protocol}"
            )
        tls, sasl = self.uses_tls, self.uses_sasl
        if sasl:
            missing = [
                f"kafka.{name}"
                for name, value in (
                    ("sasl_mechanism", self.sasl_mechanism),
                    ("sasl_username", self.sasl_username),
                    ("sasl_password", self.sasl_password and self.sasl_password.get_secret_value()),
                )
                if not value
            ]
            if missing:
                raise ValueError(
                    f"kafka.security_protocol = {self.security_protocol} needs {', '.join(missing)} "
                    f"(the password from FLYWHEEL_KAFKA__SASL_PASSWORD or the config file)"
                )
        else:
            stray = [n for n in ("sasl_mechanism", "sasl_username", "sasl_password") if getattr(self, n)]
            if stray:
                raise ValueError(
                    f"kafka.{stray[0]} is set but kafka.security_protocol = {self.security_protocol} sends no login: "
                    f"set security_protocol to SASL_SSL (or SASL_PLAINTEXT), or remove it"
                )
        tls_files = ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_key_password")
        if not tls:
            stray = [n for n in (*tls_files, "ssl_system_trust") if getattr(self, n)]
            if stray:
                raise ValueError(
                    f"kafka.{stray[0]} is set but kafka.security_protocol = {self.security_protocol} uses no TLS: "
                    f"set security_protocol to SSL or SASL_SSL, or remove it"
                )
            return self
        if self.ssl_cafile is not None and self.ssl_system_trust:
            raise ValueError("kafka.ssl_cafile and kafka.ssl_system_trust = true exclude each other: trust one of them")
        if self.ssl_cafile is None and not self.ssl_system_trust and self.local_listener != "sasl_ssl":
            raise ValueError(
                f"kafka.security_protocol = {self.security_protocol} needs the CA that signed the brokers' certificates: "
                f"set kafka.ssl_cafile to its PEM file, or kafka.ssl_system_trust = true for publicly signed "
                f"brokers (Confluent Cloud, MSK)"
            )
        if self.ssl_cafile is not None and (self.local_listener != "sasl_ssl" or self.ssl_cafile.exists()):
            _check_ca_file(self.ssl_cafile)
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("kafka.ssl_keyfile needs kafka.ssl_certfile (the certificate the key belongs to)")
        if self.ssl_certfile is not None:
            _check_client_cert(self.ssl_certfile, self.ssl_keyfile, self.ssl_key_password)
        return self

    @property
    def uses_tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol in ("SASL_PLAINTEXT", "SASL_SSL")

    @property
    def managed(self) -> bool:
        """True when Flywheel runs the broker itself (no external cluster configured)."""
        return not self.bootstrap_servers

    @property
    def bootstrap(self) -> str:
        return self.bootstrap_servers or f"{self.host}:{self.port}"


def _check_local_sasl_ssl(k: KafkaSettings) -> None:
    if k.bootstrap_servers:
        raise ValueError(
            "kafka.local_listener applies to the broker `flywheel up` runs; with kafka.bootstrap_servers "
            "set, configure that cluster's kafka.security_protocol instead"
        )
    if k.security_protocol not in ("PLAINTEXT", "SASL_SSL"):  # PLAINTEXT: the default, left as it was
        raise ValueError(
            f'kafka.local_listener = "sasl_ssl" listens with SASL_SSL only, but kafka.security_protocol = '
            f"{k.security_protocol}: set it to SASL_SSL or leave it out"
        )
    k.security_protocol = "SASL_SSL"
    if k.sasl_mechanism == "PLAIN":
        raise ValueError(
            'the local sasl_ssl broker stores SCRAM credentials, not PLAIN passwords: set kafka.sasl_mechanism = "SCRAM-SHA-512"'
        )
    if k.sasl_username == LOCAL_BROKER_USER:
        raise ValueError(f"kafka.sasl_username {LOCAL_BROKER_USER!r} is the local broker's own login: choose another")
    if k.ssl_system_trust:
        raise ValueError(
            "the local sasl_ssl broker's certificate is signed by its own CA: remove kafka.ssl_system_trust"
        )


def _check_ca_file(path: Path) -> None:
    if not path.is_file() or not os.access(path, os.R_OK):
        raise ValueError(f"kafka.ssl_cafile {path} is not a readable file")
    try:
        ssl.create_default_context(cafile=str(path))
    except ssl.SSLError as e:
        raise ValueError(f"kafka.ssl_cafile {path} holds no PEM certificate ({e.reason or e})") from None


def _check_client_cert(certfile: Path, keyfile: Path | None, password: SecretStr | None) -> None:
    for name, path in (("ssl_certfile", certfile), ("ssl_keyfile", keyfile)):
        if path is not None and (not path.is_file() or not os.access(path, os.R_OK)):
            raise ValueError(f"kafka.{name} {path} is not a readable file")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(
            str(certfile), str(keyfile) if keyfile else None, password.get_secret_value() if password else None
        )
    except ssl.SSLError as e:
        raise ValueError(
            f"kafka.ssl_certfile {certfile} with its key cannot be loaded ({e.reason or e}): a PEM certificate "
            f"and the key that matches it, and kafka.ssl_key_password if the key is encrypted"
        ) from None


class DatabaseSettings(Section):
    url: str = ""
    """SQLAlchemy URL. Empty: a SQLite file `flywheel.db` in the data folder.
    PostgreSQL: `postgresql+psycopg://user:password@host:5432/flywheel`."""
    echo: bool = False
    """Log every SQL statement (debugging)."""


class S3Settings(Section):
    """The connection of an `s3://` weight store (through s3fs). Every empty field falls back to
    the standard AWS configuration: AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, ~/.aws/config and credentials, an instance role."""

    endpoint_url: str = ""
    """An S3-compatible server (`http://127.0.0.1:8333`, MinIO, SeaweedFS, R2). Empty: AWS."""
    region: str = ""
    """The bucket's region. Empty: AWS_REGION or the AWS config's."""
    access_key_id: str = ""
    """Empty: the standard AWS credential chain (environment, ~/.aws, instance role)."""
    secret_access_key: SecretStr = SecretStr("")
    """The access key's secret (prefer FLYWHEEL_STORE__S3__SECRET_ACCESS_KEY or the AWS
    environment); never printed."""
    session_token: SecretStr = SecretStr("")
    """A temporary credential's session token; never printed."""

    def storage_options(self) -> dict[str, Any]:
        """s3fs's keyword arguments for what is set; the rest is left to the AWS defaults."""
        out: dict[str, Any] = {}
        if self.endpoint_url:
            out["endpoint_url"] = self.endpoint_url
        if self.region:
            out["client_kwargs"] = {"region_name": self.region}
        if self.access_key_id:
            out["key"] = self.access_key_id
        if secret := self.secret_access_key.get_secret_value():
            out["secret"] = secret
        if token := self.session_token.get_secret_value():
            out["token"] = token
        return out


STORE_SCHEMES = ("file", "s3", "gs", "gcs")


class StoreSettings(Section):
    """The weight store every process shares (learner/store.py): where published versions live."""

    uri: str = ""
    """`file:///path`, `s3://bucket/prefix` or `gs://bucket/prefix` (gcsfs, the `gcs` extra).
    Empty: `<data_dir>/weights` on this machine."""
    cache_dir: Path | None = None
    """A reader's own copy of the payloads it fetched from an object store (deltas, full
    snapshots), named by their sha256 and checked again before each use. Empty:
    `<cache_dir>/store`. A local store is read in place."""
    cache_max_bytes: int = Field(default=4 * 2**30, ge=0)
    """Beyond this, the least recently used payloads leave the cache (0: keep nothing)."""
    debris_age_s: Seconds = 3600.0
    """On an object store (no publish lock): how old a publish that never committed must be
    before cleanup removes its objects; a younger one may still be writing."""
    s3: S3Settings = S3Settings()

    @model_validator(mode="after")
    def _known_scheme(self) -> Self:
        scheme = self.uri.partition("://")[0] if "://" in self.uri else ""
        if scheme and scheme not in STORE_SCHEMES:
            raise ValueError(f"store.uri {self.uri!r}: the scheme must be one of {', '.join(STORE_SCHEMES)}")
        return self


def _default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("flywheel", appauthor=False))


def _default_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("flywheel", appauthor=False))


class FlywheelSettings(BaseSettings):
    """Settings every process shares: where data lives, Kafka, the database."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_",
        env_nested_delimiter="__",
        extra="ignore",  # other processes' sections in the shared file
        validate_default=True,
    )

    data_dir: Path = Field(default_factory=_default_data_dir)
    """Persistent state: broker data, SQLite database, weight store, pid files, logs."""
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    """Re-creatable downloads: the Kafka broker classpath, the pretrained base model."""
    kafka: KafkaSettings = KafkaSettings()
    database: DatabaseSettings = DatabaseSettings()
    store: StoreSettings = StoreSettings()

    @model_validator(mode="after")
    def _local_broker_ca(self) -> Self:
        # The CA `flywheel up` generates for the local sasl_ssl broker lives in the data folder,
        # which only this object knows; every process derives the same path.
        if self.kafka.local_listener == "sasl_ssl" and self.kafka.ssl_cafile is None:
            self.kafka.ssl_cafile = self.local_kafka_ca
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = _TOML_FILE.get()
        sources = [init_settings, env_settings]
        if toml is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml))
        return tuple(sources)

    @classmethod
    def load(cls, config_file: str | Path | None = None, overrides: list[str] | None = None) -> Self:
        """Resolve the settings from all sources; raise UserError with one line on bad input."""
        path = _resolve_config_file(config_file)
        token = _TOML_FILE.set(path)
        try:
            return cls(**parse_overrides(overrides or []))
        except ValidationError as e:
            raise UserError(f"bad configuration: {_one_line(e, cls)}") from None
        except tomllib.TOMLDecodeError as e:
            raise UserError(f"bad configuration file {path}: {e}") from None
        finally:
            _TOML_FILE.reset(token)

    # Derived paths, in one place so every process agrees on them.
    @property
    def database_url(self) -> str:
        return self.database.url or f"sqlite:///{self.data_dir / 'flywheel.db'}"

    @property
    def local_kafka_ca(self) -> Path:
        """The CA certificate of the local sasl_ssl broker (written by `flywheel up`)."""
        return self.data_dir / "kafka" / "tls" / "ca.pem"

    @property
    def store_uri(self) -> str:
        """The weight store's URI: `store.uri`, else `<data_dir>/weights` as a file:// URI
        (published versions are state, not cache)."""
        return self.store.uri or (Path(self.data_dir).expanduser().absolute() / "weights").as_uri()

    @property
    def store_cache_dir(self) -> Path:
        return Path(self.store.cache_dir or Path(self.cache_dir) / "store").expanduser()

    @property
    def run_dir(self) -> Path:
        return self.data_dir / "run"

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "logs"

    def redacted(self) -> dict[str, Any]:
        """The resolved config as plain data, with secrets and URL passwords masked."""
        return _redact(self.model_dump(mode="json"))


class StackSettings(FlywheelSettings):
    """`flywheel up | down | status | db`: the local stack and the database."""


def _resolve_config_file(config_file: str | Path | None) -> Path | None:
    explicit = config_file or os.environ.get("FLYWHEEL_CONFIG")
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise UserError(f"config file {path} does not exist")
        return path
    local = Path("flywheel.toml")
    return local if local.is_file() else None


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["kafka.port=9093", "database.url=sqlite:///x.db"]` -> nested dict; values parse as TOML when they can."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"bad --set {item!r}: expected KEY=VALUE, e.g. --set kafka.port=9093")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare string
        node = out
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise UserError(f"bad --set {item!r}: {p} is not a section")
        node[leaf] = value
    return out


def _one_line(e: ValidationError, model: type[BaseModel] | None = None) -> str:
    """Every error of `e` on one line, with the rejected value, unless it is a secret: a field
    whose name says token, password or secret, or whose type is SecretStr (found through
    `model`). A URL in a shown value has its password masked (by UserError, which every
    message passes: feedback/core/errors.py)."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "config"
        given = err.get("input")
        msg = err["msg"]
        if isinstance(given, dict) or given is None:
            shown = ""
        elif _is_secret(model, err["loc"]):
            shown = " (value hidden: secret)"
            msg = msg.replace(repr(given), "***")  # a validator may quote it (as parse_duration does)
        else:
            shown = f" (got {given!r})"
        parts.append(f"{loc}: {msg}{shown}")
    return "; ".join(parts)


_SECRET_WORDS = ("token", "password", "secret")


def _is_secret(model: type[BaseModel] | None, loc: tuple) -> bool:
    """Does the field at `loc` (names and list indexes) hold a secret, by its name or its type?"""
    if any(isinstance(part, str) and any(w in part.lower() for w in _SECRET_WORDS) for part in loc):
        return True
    annotation: Any = model
    for part in loc:
        if not isinstance(part, str):
            continue  # a list index or a union branch: the annotation already covers it
        found = _model_in(annotation)
        if found is None or part not in found.model_fields:
            break
        annotation = found.model_fields[part].annotation
        if _mentions(annotation, (SecretStr, SecretBytes)):
            return True
    return False


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if found := _model_in(arg):
            return found
    return None


def _mentions(annotation: Any, kinds: tuple[type, ...]) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, kinds):
        return True
    return any(_mentions(arg, kinds) for arg in get_args(annotation))


def _redact(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _redact(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v, key) for v in value]
    if isinstance(value, str):
        if value and any(w in key.lower() for w in _SECRET_WORDS):
            return "***"
        if "://" in value and "@" in value:
            from sqlalchemy.engine import make_url
            from sqlalchemy.exc import ArgumentError

            try:
                return make_url(value).render_as_string(hide_password=True)
            except ArgumentError:  # not a database URL after all
                return value
    return value
