"""A single-node Apache Kafka broker (KRaft) that `flywheel up` fetches, starts and stops.

The broker is the real Apache Kafka server, resolved from Maven Central through the
`pom.xml` beside this file and cached under `<cache_dir>/kafka/<version>/libs`. Its data
(`<data_dir>/kafka`) outlives `down`/`up`, so nothing produced before `down` is lost.
`down` stops only the process `up` recorded in `<data_dir>/run/kafka.pid`.

With `kafka.local_listener = "sasl_ssl"` the client listener takes TLS and SCRAM logins only:
`up` generates the certificates (ops/kafka_tls.py), gives the broker a login of its own (a random
password kept in `<data_dir>/kafka/broker-login`, added at format time), and, once the broker
answers, sets the SCRAM credential of `kafka.sasl_username` to `kafka.sasl_password` (so a
changed password takes effect at the next `up`). The controller listener takes only clients
with a certificate from that CA (mutual TLS): no port of the broker is open without a login.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from feedback.core.config import LOCAL_BROKER_USER, FlywheelSettings, KafkaSettings
from feedback.core.errors import UserError
from feedback.core.files import open_private, private_dir
from ops import kafka_tls

POM = Path(__file__).with_name("kafka") / "pom.xml"


def kafka_version() -> str:
    """The Kafka version the pom pins (the single source of truth for it)."""
    m = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", POM.read_text())
    assert m, f"{POM} has no <kafka.version>"
    return m.group(1)


@dataclass(frozen=True)
class BrokerPaths:
    libs: Path  # [cache] the broker classpath
    data: Path  # [data] KRaft metadata and topic logs
    config: Path  # server.properties written by `up`
    pid: Path
    log: Path
    tls: Path  # [data] the sasl_ssl listener's certificates
    login: Path  # [data] the sasl_ssl broker's own password (owner-only)

    @classmethod
    def of(cls, s: FlywheelSettings) -> BrokerPaths:
        return cls(
            libs=s.cache_dir / "kafka" / kafka_version() / "libs",
            data=s.data_dir / "kafka",
            config=s.data_dir / "kafka" / "server.properties",
            pid=s.run_dir / "kafka.pid",
            log=s.log_dir / "kafka.log",
            tls=s.local_kafka_ca.parent,
            login=s.data_dir / "kafka" / "broker-login",
        )

    @property
    def formatted(self) -> bool:
        return (self.data / "logs" / "meta.properties").exists()


# --- prerequisites ---------------------------------------------------------------------------


def find_java() -> str:
    """The `java` binary (JAVA_HOME first, then PATH); Kafka 4 needs Java 17 or newer."""
    home = os.environ.get("JAVA_HOME")
    candidates = [str(Path(home) / "bin" / "java")] if home else []
    candidates.append(shutil.which("java") or "")
    for c in candidates:
        if c and os.access(c, os.X_OK):
            out = subprocess.run([c, "-version"], capture_output=True, text=True).stderr
            m = re.search(r'version "(\d+)', out)
            if m and int(m.group(1)) < 17:
                raise UserError(f"Kafka 4 needs Java 17 or newer, found Java {m.group(1)} at {c}")
            return c
    raise UserError(
        "Java not found: Kafka needs Java 17+ (apt-get install openjdk-17-jre-headless), "
        "or set kafka.bootstrap_servers to use an existing Kafka cluster"
    )


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def fetch_classpath(libs: Path, progress: Callable[[str], None]) -> None:
    """Resolve the broker jars from Maven Central into `libs` (once; later calls return at once)."""
    if (libs / ".complete").exists():
        return
    mvn = shutil.which("mvn")
    if mvn is None:
        raise UserError("Maven (mvn) not found: it fetches the Kafka broker once (apt-get install maven)")
    partial = libs.with_name("libs.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    cmd = [mvn, "-B", "-f", str(POM), "dependency:copy-dependencies", f"-DoutputDirectory={partial}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    artifacts, tail = 0, []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        if line.startswith("Downloaded from"):
            artifacts += 1
            name = line.split("/")[-1].split(" ")[0]
            progress(f"fetching Kafka {kafka_version()} from Maven Central: {artifacts} files ({name})")
    if proc.wait() != 0:
        errors = [t for t in tail if "ERROR" in t] or tail[-1:]
        raise UserError(f"fetching Kafka from Maven Central failed: {errors[0] if errors else 'mvn exited non-zero'}")
    (partial / ".complete").write_text(kafka_version())
    shutil.rmtree(libs, ignore_errors=True)
    partial.rename(libs)  # publish the cache only when it is whole


# --- configuration and storage ----------------------------------------------------------------


def server_properties(s: FlywheelSettings, data: Path, secured: _Secured | None = None) -> str:
    """The broker's configuration; `secured` (the sasl_ssl listener's files and the broker's own
    password) turns the plaintext listeners into SASL_SSL and mutual-TLS ones."""
    k = s.kafka
    listeners = _secured_listeners(k, secured) if secured else _plaintext_listeners(k)
    return "\n".join(
        [
            "# Written by `flywheel up`; edit flywheel.toml instead.",
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.voters=1@{k.host}:{k.controller_port}",
            "controller.listener.names=CONTROLLER",
            *listeners,
            f"log.dirs={data / 'logs'}",
            # A single node: every internal topic has one replica.
            "offsets.topic.replication.factor=1",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
            "group.initial.rebalance.delay.ms=0",
            # Topics are created explicitly with their partition counts and retention.
            "auto.create.topics.enable=false",
            "",
        ]
    )


def _plaintext_listeners(k: KafkaSettings) -> list[str]:
    return [
        f"listeners=PLAINTEXT://{k.host}:{k.port},CONTROLLER://{k.host}:{k.controller_port}",
        f"advertised.listeners=PLAINTEXT://{k.host}:{k.port}",
        "inter.broker.listener.name=PLAINTEXT",
        "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
    ]


@dataclass(frozen=True)
class _Secured:
    tls: kafka_tls.BrokerTLS
    broker_password: str  # the broker's own SCRAM login (token_urlsafe: no quoting needed)


BROKER_MECHANISM = "SCRAM-SHA-512"  # the broker's own login


def _secured_listeners(k: KafkaSettings, secured: _Secured) -> list[str]:
    mechanisms = sorted({BROKER_MECHANISM, k.sasl_mechanism or BROKER_MECHANISM})
    # Each enabled mechanism needs a JAAS entry on the listener; the username and password are
    # the broker's own, used only when it connects to itself as a client.
    login = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{LOCAL_BROKER_USER}" password="{secured.broker_password}";'
    )
    return [
        f"listeners=SASL_SSL://{k.host}:{k.port},CONTROLLER://{k.host}:{k.controller_port}",
        f"advertised.listeners=SASL_SSL://{k.host}:{k.port}",
        "inter.broker.listener.name=SASL_SSL",
        "listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:SSL",
        f"sasl.enabled.mechanisms={','.join(mechanisms)}",
        f"sasl.mechanism.inter.broker.protocol={BROKER_MECHANISM}",
        *(f"listener.name.sasl_ssl.{m.lower()}.sasl.jaas.config={login}" for m in mechanisms),
        "ssl.keystore.type=PEM",
        f"ssl.keystore.location={secured.tls.keystore}",
        "ssl.truststore.type=PEM",
        f"ssl.truststore.location={secured.tls.ca}",
        # Controller port: only the broker itself, with its certificate (no password to leak).
        "listener.name.controller.ssl.client.auth=required",
    ]


def _log4j_config(log: Path) -> str:
    return "\n".join(
        [
            "appender.file.type = File",
            "appender.file.name = file",
            f"appender.file.fileName = {log}",
            "appender.file.layout.type = PatternLayout",
            "appender.file.layout.pattern = [%d] %p %m (%c)%n",
            "rootLogger.level = INFO",
            "rootLogger.appenderRef.file.ref = file",
            "logger.kafka.name = org.apache.kafka",
            "logger.kafka.level = WARN",
            "",
        ]
    )


def _java_cmd(java: str, paths: BrokerPaths, heap: str, main: str, *args: str) -> list[str]:
    log4j = paths.data / "log4j2.properties"
    return [
        java,
        f"-Xmx{heap}",
        f"-Xms{heap}",
        "-XX:+UseG1GC",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={log4j}",
        "-cp",
        str(paths.libs / "*"),
        main,
        *args,
    ]


def _format_storage(java: str, paths: BrokerPaths, heap: str, secured: _Secured | None) -> None:
    if paths.formatted:
        return  # formatted by an earlier `up`; formatting again would refuse anyway
    cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    args = ["kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(paths.config)]
    if secured:
        args += ["--add-scram", f"{BROKER_MECHANISM}=[name={LOCAL_BROKER_USER},password={secured.broker_password}]"]
    # The arguments go in an owner-only @argfile (the JDK launcher reads it), so the password is
    # never on a command line, where any user of the machine could read it in /proc.
    argfile = paths.data / "format.args"
    with open_private(argfile) as f:
        f.write("\n".join(f'"{a}"' for a in args).encode())
    try:
        out = subprocess.run(_java_cmd(java, paths, "256m", f"@{argfile}"), capture_output=True, text=True)
    finally:
        argfile.unlink(missing_ok=True)
    if out.returncode != 0:
        lines = [ln.strip() for ln in (out.stderr + out.stdout).splitlines() if ln.strip()]
        reason = next(
            (ln for ln in reversed(lines) if "Exception" in ln or "Error" in ln or "error" in ln),
            lines[-1] if lines else "no output",
        )
        raise UserError(f"formatting Kafka storage in {paths.data} failed (exit {out.returncode}): {reason[:300]}")


# --- process lifecycle ------------------------------------------------------------------------


def recorded_pid(paths: BrokerPaths) -> int | None:
    """The pid `up` recorded, if that process is still our broker; clears a stale pid file."""
    try:
        pid = int(paths.pid.read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        cmdline = ""
    # Only a live process running *this* broker config counts: pids are reused.
    if "kafka.Kafka" in cmdline and str(paths.config) in cmdline:
        return pid
    paths.pid.unlink(missing_ok=True)
    return None


def start(s: FlywheelSettings, progress: Callable[[str], None]) -> int:
    """Fetch (first time), format (first time) and start the broker; return its pid."""
    paths = BrokerPaths.of(s)
    if (pid := recorded_pid(paths)) is not None:
        return pid
    java = find_java()
    k = s.kafka
    for port in (k.port, k.controller_port):
        if not port_free(k.host, port):
            raise UserError(
                f"port {port} on {k.host} is already in use; stop whatever holds it "
                f"or choose another with --set kafka.port=... / kafka.controller_port=..."
            )
    fetch_classpath(paths.libs, progress)
    for folder in (paths.data, paths.pid.parent, paths.log.parent):  # in the data folder: owner-only
        private_dir(folder)
    secured = _secure(s, paths, progress) if k.local_listener == "sasl_ssl" else None
    with open_private(paths.config) as f:  # owner-only: with sasl_ssl it holds the broker's password
        f.write(server_properties(s, paths.data, secured).encode())
    (paths.data / "log4j2.properties").write_text(_log4j_config(paths.log))
    progress("formatting Kafka storage")
    try:
        _format_storage(java, paths, k.heap, secured)
    except UserError:
        # Seen once in CI, right after the vLLM tests, with its cause cut off; formatting
        # an unformatted folder is idempotent, so one more try is safe (the second error stands).
        time.sleep(2)
        _format_storage(java, paths, k.heap, secured)
    progress(f"starting Kafka {kafka_version()} on {k.host}:{k.port}")
    with open(paths.log.with_suffix(".out"), "ab") as out:
        proc = subprocess.Popen(
            _java_cmd(java, paths, k.heap, "kafka.Kafka", str(paths.config)),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # survives the CLI; `down` stops it by pid
        )
    paths.pid.write_text(f"{proc.pid}\n")
    return proc.pid


def _secure(s: FlywheelSettings, paths: BrokerPaths, progress: Callable[[str], None]) -> _Secured:
    """The sasl_ssl listener's certificates (made if missing or stale) and the broker's own password."""
    if paths.formatted and not paths.login.exists():
        raise UserError(
            f'kafka.local_listener = "sasl_ssl", but the local broker\'s storage in {paths.data} was formatted '
            f"without it, so the broker has no login of its own: use another data_dir, or remove "
            f"{paths.data} (its topics are lost) and run `flywheel up` again"
        )
    tls, made = kafka_tls.ensure_broker_tls(paths.tls, s.kafka.host)
    if made:
        progress(f"generated a CA and a broker certificate for {s.kafka.host} in {paths.tls}")
    if not paths.login.exists():
        with open_private(paths.login) as f:
            f.write(secrets.token_urlsafe(32).encode())
    return _Secured(tls, paths.login.read_text().strip())


def broker_login(s: FlywheelSettings) -> KafkaSettings:
    """Kafka settings that log in as the local sasl_ssl broker's own user (its super user)."""
    login = BrokerPaths.of(s).login
    if not login.exists():  # `up` with sasl_ssl while a broker started without it still runs
        raise UserError(
            'kafka.local_listener = "sasl_ssl", but the running local broker was started without it: '
            "run `flywheel down`, then `flywheel up`"
        )
    password = login.read_text().strip()
    return s.kafka.model_copy(
        update={
            "sasl_username": LOCAL_BROKER_USER,
            "sasl_password": SecretStr(password),
            "sasl_mechanism": BROKER_MECHANISM,
        }
    )


def set_client_login(s: FlywheelSettings, timeout_s: float) -> None:
    """Give `kafka.sasl_username` a SCRAM credential with `kafka.sasl_password` on the local
    sasl_ssl broker, and wait until that login is accepted (the broker applies it asynchronously)."""
    from kafka.admin._users import UserScramCredentialUpsertion

    from feedback import bus

    k = s.kafka
    assert k.sasl_password is not None and k.sasl_mechanism is not None  # KafkaSettings requires both
    client = bus.admin(broker_login(s))
    try:
        errors = client.alter_user_scram_credentials(
            [UserScramCredentialUpsertion(k.sasl_username, k.sasl_mechanism, k.sasl_password.get_secret_value())]
        )
    finally:
        client.close()
    if error := errors.get(k.sasl_username):
        raise UserError(f"the local Kafka broker refused the SCRAM credential for {k.sasl_username}: {error}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            bus.check_security(k, timeout_s=min(timeout_s, 5.0))
            return
        except bus.KafkaRefused:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def wait_until_exited(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            # Reap it if it is our child (the test session starts brokers in-process).
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        if not Path(f"/proc/{pid}").exists() or _is_zombie(pid):
            return True
        time.sleep(0.1)
    return False


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return True


def stop(s: FlywheelSettings, timeout_s: float = 30.0) -> int | None:
    """Stop the broker `up` started (SIGTERM, then SIGKILL after `timeout_s`); return its pid."""
    paths = BrokerPaths.of(s)
    pid = recorded_pid(paths)
    if pid is None:
        return None
    os.kill(pid, signal.SIGTERM)  # Kafka shuts down cleanly on SIGTERM
    if not wait_until_exited(pid, timeout_s):
        os.kill(pid, signal.SIGKILL)
        wait_until_exited(pid, 5.0)
    paths.pid.unlink(missing_ok=True)
    return pid


def broker_exited_early(paths: BrokerPaths, pid: int) -> str | None:
    """If the broker died during start-up, the reason from its log."""
    if Path(f"/proc/{pid}").exists() and not _is_zombie(pid):
        return None
    wait_until_exited(pid, 0.1)
    lines: list[str] = []
    for f in (paths.log, paths.log.with_suffix(".out")):
        if f.exists():
            lines += f.read_text(errors="replace").splitlines()[-200:]
    errors = [ln for ln in lines if "ERROR" in ln or "Exception" in ln]
    return (errors or lines or ["no log output"])[-1][:300]
