"""Pure helpers for the local stack: file locations, rendered configs and command lines.

Nothing here starts a process or touches the network; the component modules (kafka_broker,
postgres, podman_service, cluster) do that.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import uuid
from dataclasses import dataclass
from pathlib import Path
from string import Template

from services.common.settings import PROJECT_ROOT, Settings

COMPOSE_DIR = PROJECT_ROOT / "compose"
KAFKA_POM = COMPOSE_DIR / "kafka" / "pom.xml"
KAFKA_PROPERTIES_TEMPLATE = COMPOSE_DIR / "kafka" / "server.properties"
KAFKA_LOG4J2 = COMPOSE_DIR / "kafka" / "log4j2.properties"

# Directories and symlinks of the sandbox base image besides /bin/busybox and its applets.
IMAGE_DIRS = ("bin", "dev", "etc", "proc", "root", "run", "sys", "tmp", "var", "workspace")
IMAGE_SYMLINKS = {"sbin": "bin", "usr/bin": "../bin", "usr/sbin": "../bin"}
IMAGE_FILES = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
}
IMAGE_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "WORKDIR /workspace",
    'CMD ["/bin/sh"]',
    "LABEL io.sandstream.image=base",
)


@dataclass(frozen=True)
class KafkaPaths:
    libs: Path  # resolved broker jars (download cache)
    home: Path  # runtime directory of the broker
    properties: Path
    data: Path
    cluster_id: Path
    log: Path
    format_log: Path
    pid: Path


@dataclass(frozen=True)
class PodmanPaths:
    home: Path
    log: Path
    pid: Path


def kafka_paths(settings: Settings) -> KafkaPaths:
    home = settings.state_dir / "kafka"
    return KafkaPaths(
        libs=settings.cache_dir / f"kafka-{settings.kafka_version}" / "libs",
        home=home,
        properties=home / "server.properties",
        data=home / "data",
        cluster_id=home / "cluster.id",
        log=home / "broker.log",
        format_log=home / "format.log",
        pid=home / "broker.pid",
    )


def podman_paths(settings: Settings) -> PodmanPaths:
    home = settings.state_dir / "podman"
    return PodmanPaths(home=home, log=home / "service.log", pid=home / "service.pid")


def postgres_marker(settings: Settings) -> Path:
    """Exists while the PostgreSQL cluster runs because our `up` started it."""
    return settings.state_dir / "postgres" / "started-by-sandstream"


def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def is_local_host(host: str) -> bool:
    """True when ``host`` is this machine, i.e. a component the stack starts itself."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def new_kafka_cluster_id() -> str:
    """A cluster id in Kafka's format: a random UUID, URL-safe base64 without padding."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):  # Kafka never generates these (they look like flags)
            return text


def render_server_properties(template: str, settings: Settings) -> str:
    host, port = split_host_port(settings.kafka_bootstrap)
    return Template(template).substitute(
        host=host,
        broker_port=port,
        controller_port=settings.kafka_controller_port,
        data_dir=kafka_paths(settings).data,
        partitions=settings.kafka_partitions,
    )


# With three or more brokers a write is acknowledged once two replicas have it (the producers
# use acks=all), so one broker can be lost without losing an acknowledged record or stopping.
MAX_REPLICATION = 3
CLUSTER_MIN_INSYNC = 2


def set_properties(text: str, values: dict[str, str], header: str | None = None) -> str:
    """``text`` (a .properties file) with each key set to its value: on every line that sets
    the key, or appended (after ``header``, as a comment, when given) where none does."""
    lines = text.splitlines()
    missing = dict(values)
    for i, line in enumerate(lines):
        key, sep, _ = line.partition("=")
        key = key.strip()
        if sep and not line.lstrip().startswith("#") and key in values:
            lines[i] = f"{key}={values[key]}"
            missing.pop(key, None)
    if missing:
        lines += ["", f"# {header}"] if header else []
        lines += [f"{key}={value}" for key, value in missing.items()]
    return "\n".join(lines) + "\n"


def replication_factor(settings: Settings) -> int:
    """Replicas of every project topic: one per broker, at most three."""
    return min(MAX_REPLICATION, settings.kafka_brokers)


def min_insync_replicas(settings: Settings) -> int:
    return CLUSTER_MIN_INSYNC if settings.kafka_brokers >= MAX_REPLICATION else 1


def topic_configs(settings: Settings) -> dict[str, str]:
    """Configs every project topic is created with: retention explicit (forever by default),
    never left to the broker's default, since a replay needs the log from offset 0; on a
    cluster, the replicas an acknowledged write needs; and the broker's append time on every
    record, from which the processor counts a command's time (a command published late, after
    an outage, takes effect when it enters the log: services/processor/intake.py)."""
    return {
        "retention.ms": str(settings.kafka_retention_ms),
        "message.timestamp.type": "LogAppendTime",
        "retention.bytes": "-1",
        "min.insync.replicas": str(min_insync_replicas(settings)),
    }


def kafka_java_command(settings: Settings, main_class: str, *args: str) -> list[str]:
    paths = kafka_paths(settings)
    return [
        "java",
        f"-Xmx{settings.kafka_heap}",
        # The JIT's first tier only (C1): with C2 on, a fresh broker here spent half its CPU
        # compiling (10 of 20 s over a bench's two bursts of 300, still compiling in the
        # second), and an idle one kept compiling for minutes; C1's code served the same
        # requests for no more CPU (docs/benchmarks.md, "The broker's JVM"). A broker of the
        # local stack, never a production cluster's.
        "-XX:TieredStopAtLevel=1",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={KAFKA_LOG4J2}",
        "-cp",
        f"{paths.libs}/*",  # expanded by java itself, not by a shell
        main_class,
        *args,
    ]


def maven_command(settings: Settings, output_dir: Path) -> list[str]:
    return [
        "mvn",
        "-q",
        "-B",
        "-Dstyle.color=never",
        "-f",
        str(KAFKA_POM),
        f"-Dkafka.version={settings.kafka_version}",
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={output_dir}",
    ]


def podman_service_command(settings: Settings) -> list[str]:
    return ["podman", "system", "service", "--time=0", settings.podman_url]


PG_BOOTSTRAP_SQL = """\
SELECT format('CREATE ROLE %I LOGIN', :'role')
 WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'role') \\gexec
SELECT format('ALTER ROLE %I LOGIN PASSWORD %L', :'role', :'password') \\gexec
SELECT format('CREATE DATABASE %I OWNER %I', :'database', :'role')
 WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'database') \\gexec
"""
SCRAM_ITERATIONS = 4096  # PostgreSQL's default scram_iterations


def psql_bootstrap_args(settings: Settings) -> list[str]:
    """psql arguments (run as the postgres superuser) that create our role and database.

    Names travel as psql variables and are quoted by format() on the server; the password is
    not among them (a command line is visible to every user): ``psql_bootstrap_input`` sends it
    on standard input.
    """
    return [
        "psql",
        "-X",
        "-q",
        "-v",
        "ON_ERROR_STOP=1",
        "-p",
        str(settings.pg_port),
        "-v",
        f"role={settings.pg_user}",
        "-v",
        f"database={settings.pg_database}",
    ]


def psql_bootstrap_input(password: str, salt: bytes) -> str:
    """psql's standard input: the password (as a SCRAM verifier when it is ASCII, so that not
    even a server log of the statement holds it), then the bootstrap SQL."""
    stored = scram_verifier(password, salt) if password.isascii() else password
    return f"\\set password {psql_quote(stored)}\n{PG_BOOTSTRAP_SQL}"


def psql_quote(value: str) -> str:
    """A value quoted for a psql meta-command argument (quotes doubled, backslashes escaped)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def scram_verifier(password: str, salt: bytes, iterations: int = SCRAM_ITERATIONS) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802/7677; an ASCII
    password is its own SASLprep), which ALTER ROLE ... PASSWORD accepts as it is."""
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()
    b64 = base64.b64encode
    return (
        f"SCRAM-SHA-256${iterations}:{b64(salt).decode()}"
        f"${b64(stored_key).decode()}:{b64(server_key).decode()}"
    )
