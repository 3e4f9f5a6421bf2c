"""Start, stop and inspect the local stack: Kafka (single-node KRaft), PostgreSQL 15, Podman.

    python -m services.localstack up | down | status

``up`` is idempotent: it starts only what is not running (a second ``up`` restarts nothing),
creates the Kafka topics, the PostgreSQL role and database, applies the SQL migrations and
builds the sandbox base image when they are missing. ``down`` stops what ``up`` started:
the broker and the Podman API service by their pid files, the PostgreSQL cluster only when
``up`` had to start it. Containers are the drivers' business and are left alone.

Runtime files (configs, data, logs, pid files, the Podman socket) live under
``settings.state_dir``; downloaded broker jars under ``settings.cache_dir``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from podman import PodmanClient

from services.common.kafka_clients import TLS_PROTOCOLS, kafka_client_args
from services.common.migrations import apply_migrations
from services.common.secret_files import create_secret_file, read_secret_file
from services.common.settings import Settings
from services.localstack import config as cfg
from services.localstack import kafka_auth

KAFKA_START_TIMEOUT = 90.0
PODMAN_START_TIMEOUT = 30.0
PG_CONNECT_TIMEOUT = 20.0
TOPICS_READY_TIMEOUT = 30.0
STOP_TIMEOUT = 60.0
EXEC_TIMEOUT = 10.0
TOPIC_ALREADY_EXISTS = 36  # Kafka error code


class StackError(RuntimeError):
    """A component could not be brought up; the message says which one and why."""


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    running: bool
    detail: str


def _say(message: str) -> None:
    print(f"stack: {message}", flush=True)


# --------------------------------------------------------------------------- entry points


def up(settings: Settings) -> Settings:
    """Bring every component up; do nothing for those already running. The settings returned
    carry the PostgreSQL password (generated on the first `up` of a local server)."""
    started = time.monotonic()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    broker = _start_kafka(settings)  # the JVM boots while PostgreSQL and Podman come up
    settings = _up_postgres(settings)
    _up_podman(settings)
    _wait_kafka(settings, broker)
    ensure_topics(settings)
    _ensure_auth(settings)
    _say(f"up in {time.monotonic() - started:.1f}s")
    return settings


def down(settings: Settings) -> None:
    """Stop what `up` started and leave nothing of ours running."""
    kafka = cfg.kafka_paths(settings)
    stopped = _stop_pid(kafka.pid, str(kafka.properties), "kafka broker")
    _say("kafka: stopped" if stopped else "kafka: not running")

    podman = cfg.podman_paths(settings)
    stopped = _stop_pid(podman.pid, settings.podman_url, "podman service")
    if stopped:
        settings.podman_socket_path.unlink(missing_ok=True)
    _say("podman: service stopped" if stopped else "podman: service not running")

    marker = cfg.postgres_marker(settings)
    if marker.exists():
        result = _pg_ctl(settings, "stop")
        if result.returncode != 0 and _pg_ctl(settings, "status").returncode == 0:
            raise StackError(f"postgres: stopping the cluster failed:\n{_output(result)}")
        marker.unlink()
        _say("postgres: cluster stopped")
    else:
        _say("postgres: not started by `up`; left as it is")


def status(settings: Settings) -> list[ComponentStatus]:
    """Print and return the state of each component."""
    components = [_kafka_status(settings), _postgres_status(settings), _podman_status(settings)]
    for c in components:
        print(f"{c.name:<10} {'up' if c.running else 'DOWN':<5} {c.detail}", flush=True)
    return components


# --------------------------------------------------------------------------- processes


def _live_pid(pidfile: Path, marker: str) -> int | None:
    """The pid in ``pidfile`` if that process lives and its command line contains ``marker``.

    The marker (a path unique to this checkout) guards against a reused pid.
    """
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = _cmdline(pid)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    state = stat.rpartition(")")[2].split()[0]
    if state in ("Z", "X") or marker.encode() not in cmdline:
        return None
    return pid


def _cmdline(pid: int) -> bytes:
    """The process's command line, once it has one.

    A process in the middle of exec reads an empty command line: its new program's memory
    holds no arguments until the kernel has loaded that program, which can end after the
    parent's Popen has returned (and long after, on a loaded machine). Such a process already
    has its executable (a kernel thread or a process tearing down has none), so wait for its
    arguments rather than take it for a stranger.
    """
    deadline = time.monotonic() + EXEC_TIMEOUT
    while not (cmdline := Path(f"/proc/{pid}/cmdline").read_bytes()):
        os.readlink(f"/proc/{pid}/exe")  # OSError: no program, so never a command line
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return cmdline


def _spawn(
    cmd: list[str], *, log: Path, pidfile: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` detached (own session, output appended to ``log``), record its pid."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"\n--- {time.strftime('%F %T')} starting: {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
            env=env,
            start_new_session=True,
        )
    pidfile.write_text(f"{proc.pid}\n")
    return proc


def _stop_pid(pidfile: Path, marker: str, what: str, timeout: float = STOP_TIMEOUT) -> bool:
    """SIGTERM the recorded process, SIGKILL it after ``timeout``; False if none was running."""
    pid = _live_pid(pidfile, marker)
    if pid is None:
        pidfile.unlink(missing_ok=True)
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    killed = False
    while _live_pid(pidfile, marker) is not None:
        if time.monotonic() > deadline:
            if killed:
                raise StackError(f"{what} (pid {pid}) survived SIGKILL")
            _say(f"{what} (pid {pid}) ignored SIGTERM for {timeout:.0f}s; killing it")
            os.kill(pid, signal.SIGKILL)
            killed, deadline = True, time.monotonic() + 10
        time.sleep(0.1)
    pidfile.unlink(missing_ok=True)
    return True


def _wait_for(
    ready: Callable[[], bool],
    *,
    what: str,
    timeout: float,
    log: Path,
    proc: subprocess.Popen[bytes] | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc is not None and proc.poll() is not None:
            raise StackError(f"{what} exited with code {proc.returncode}\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise StackError(f"{what} not ready after {timeout:.0f}s\n{_tail(log)}")
        time.sleep(0.25)


def _run(cmd: list[str], *, what: str, env: dict[str, str] | None = None) -> str:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    except FileNotFoundError as exc:
        raise StackError(f"{what}: {cmd[0]} not found; run `bash compose/bootstrap.sh`") from exc
    if result.returncode != 0:
        raise StackError(f"{what} failed (exit {result.returncode}):\n{_output(result)}")
    return result.stdout


def _output(result: subprocess.CompletedProcess[str]) -> str:
    return "\n".join(part.strip() for part in (result.stdout, result.stderr) if part.strip())


def _tail(path: Path, lines: int = 12) -> str:
    """The first errors (with the line after each) and the last lines of the latest run."""
    try:
        text = path.read_text(errors="replace").split("\n--- ")[-1].splitlines()
    except OSError:
        return f"(no log at {path})"
    errors = [i for i, line in enumerate(text) if " ERROR " in line or " FATAL " in line][:3]
    shown = [line for i in errors for line in text[i : i + 2]]
    shown += ["..."] if shown else []
    shown += text[-lines:]
    return f"from {path}:\n" + "\n".join(f"    {line}" for line in shown)


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _port_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


# --------------------------------------------------------------------------- Kafka


def _tls_problem(settings: Settings) -> str | None:
    """Why a broker of the local stack's cannot serve these settings' TLS clients, if so: its
    client listener takes no TLS, so they would fail their handshakes until the start timeout."""
    if settings.kafka_security_protocol not in TLS_PROTOCOLS:
        return None
    return (
        f"kafka: the local stack's broker takes no TLS, but SANDSTREAM_KAFKA_SECURITY_PROTOCOL is "
        f"{settings.kafka_security_protocol}: use SASL_PLAINTEXT (or PLAINTEXT) locally, or point "
        "SANDSTREAM_KAFKA_BOOTSTRAP at a TLS cluster of your own (docs/security.md)"
    )


def _start_kafka(settings: Settings) -> subprocess.Popen[bytes] | None:
    """Start the broker if it should run here and does not; return the new process."""
    host, port = cfg.split_host_port(settings.kafka_bootstrap)
    paths = cfg.kafka_paths(settings)
    if not cfg.is_local_host(host):
        _say(f"kafka: using external cluster {settings.kafka_bootstrap}")
        return None
    pid = _live_pid(paths.pid, str(paths.properties))
    if pid is not None:
        problem = kafka_auth.storage_problem(settings) or _tls_problem(settings)
        if problem:
            raise StackError(problem)
        _say(f"kafka: running (pid {pid})")
        return None
    if _port_open(host, port):
        _say(f"kafka: {settings.kafka_bootstrap} is served by a process we did not start; using it")
        return None
    problem = _tls_problem(settings)
    if problem:
        raise StackError(problem)
    _resolve_kafka_libs(settings)
    template = cfg.KAFKA_PROPERTIES_TEMPLATE.read_text()
    rendered = cfg.render_server_properties(template, settings)
    properties, jvm_options = kafka_auth.prepare_broker(settings, rendered)
    _write_if_changed(paths.properties, properties)
    _format_kafka_storage(settings)
    proc = _spawn(
        kafka_auth.with_jvm_options(
            cfg.kafka_java_command(settings, "kafka.Kafka", str(paths.properties)), jvm_options
        ),
        log=paths.log,
        pidfile=paths.pid,
    )
    _say(f"kafka: broker starting (pid {proc.pid}), log {paths.log}")
    return proc


def _wait_kafka(settings: Settings, proc: subprocess.Popen[bytes] | None) -> None:
    started = time.monotonic()
    _wait_for(
        lambda: _kafka_answers(settings),
        what="kafka broker",
        timeout=KAFKA_START_TIMEOUT,
        log=cfg.kafka_paths(settings).log,
        proc=proc,
    )
    if proc is not None:
        _say(f"kafka: broker ready after {time.monotonic() - started:.1f}s more")


def _resolve_kafka_libs(settings: Settings) -> None:
    """Copy kafka_2.13 and its runtime dependencies from Maven into the cache, once."""
    libs = cfg.kafka_paths(settings).libs
    stamp = libs / ".resolved"
    wanted = f"{settings.kafka_version} {hashlib.sha256(cfg.KAFKA_POM.read_bytes()).hexdigest()}"
    if stamp.exists() and stamp.read_text().strip() == wanted:
        return
    _say(f"kafka: resolving kafka_2.13:{settings.kafka_version} with Maven into {libs}")
    partial = libs.with_name("libs.partial")
    shutil.rmtree(partial, ignore_errors=True)
    _run(cfg.maven_command(settings, partial), what="maven dependency:copy-dependencies")
    (partial / ".resolved").write_text(wanted + "\n")
    shutil.rmtree(libs, ignore_errors=True)
    partial.rename(libs)


def _format_kafka_storage(settings: Settings) -> None:
    """Format the KRaft storage directory once, with a cluster id kept in the state dir."""
    paths = cfg.kafka_paths(settings)
    if (paths.data / "meta.properties").exists():
        problem = kafka_auth.storage_problem(settings)
        if problem:
            raise StackError(problem)
        return
    if not paths.cluster_id.exists():
        paths.cluster_id.write_text(cfg.new_kafka_cluster_id() + "\n")
    cluster_id = paths.cluster_id.read_text().strip()
    cmd = cfg.kafka_java_command(
        settings,
        "kafka.tools.StorageTool",
        "format",
        "--cluster-id",
        cluster_id,
        "--config",
        str(paths.properties),
        "--ignore-formatted",
    )
    with (
        kafka_auth.format_command(settings, cmd, "kafka.tools.StorageTool") as cmd,
        paths.format_log.open("wb") as out,
    ):
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        raise StackError(f"kafka: formatting storage failed\n{_tail(paths.format_log)}")
    kafka_auth.storage_formatted(settings)


def _kafka_answers(settings: Settings) -> bool:
    """True when the broker accepts connections and answers a metadata request."""
    if not _port_open(*cfg.split_host_port(settings.kafka_bootstrap)):
        return False
    try:
        asyncio.run(_list_topics(settings))
    except Exception:
        return False
    return True


async def _list_topics(settings: Settings) -> list[str]:
    admin = AIOKafkaAdminClient(**kafka_client_args(settings, "admin"), request_timeout_ms=5000)
    await admin.start()
    try:
        topics: list[str] = await admin.list_topics()
        return topics
    finally:
        await admin.close()


def ensure_topics(settings: Settings) -> None:
    """Create the missing project topics and wait for their leaders; StackError if not."""
    created = asyncio.run(_create_topics(settings))
    if created:
        _say(f"kafka: created topics {', '.join(created)}")
    _say(f"kafka: topics ready ({settings.kafka_partitions} partitions each)")


async def _create_topics(settings: Settings) -> list[str]:
    """Create the missing project topics; fail on a partition count other than configured."""
    admin = AIOKafkaAdminClient(**kafka_client_args(settings, "admin"))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [t for t in settings.topics if t not in existing]
        if missing:
            response = await admin.create_topics(
                [
                    NewTopic(
                        t,
                        settings.kafka_partitions,
                        cfg.replication_factor(settings),
                        topic_configs=cfg.topic_configs(settings),
                    )
                    for t in missing
                ]
            )
            for topic, code, message in response.topic_errors:
                if code not in (0, TOPIC_ALREADY_EXISTS):
                    raise StackError(f"kafka: creating topic {topic} failed ({code}): {message}")
        await _wait_topics_ready(admin, settings)
        return missing
    finally:
        await admin.close()


async def _wait_topics_ready(admin: AIOKafkaAdminClient, settings: Settings) -> None:
    """Wait until every partition of the project topics has a leader."""
    deadline = time.monotonic() + TOPICS_READY_TIMEOUT
    while True:
        pending = []
        for topic in await admin.describe_topics(list(settings.topics)):
            partitions = topic["partitions"]
            if topic["error_code"] == 0 and len(partitions) != settings.kafka_partitions:
                raise StackError(
                    f"kafka: topic {topic['topic']} has {len(partitions)} partitions but "
                    f"settings.kafka_partitions is {settings.kafka_partitions}; delete the topic "
                    f"(or {settings.state_dir / 'kafka'}) or change SANDSTREAM_KAFKA_PARTITIONS"
                )
            if topic["error_code"] != 0 or any(p["leader"] < 0 for p in partitions):
                pending.append(topic["topic"])
        if not pending:
            return
        if time.monotonic() > deadline:
            raise StackError(f"kafka: topics without leaders after timeout: {pending}")
        await asyncio.sleep(0.2)


def _ensure_auth(settings: Settings) -> None:
    """The roles' SCRAM users and ACLs on a local broker (a real cluster's are its operator's:
    docs/security.md)."""
    if not kafka_auth.enabled(settings):
        _say("kafka: no authentication (kafka_security_protocol PLAINTEXT)")
        return
    addresses = settings.kafka_bootstrap.split(",")  # a local cluster's clients get every node
    if not all(cfg.is_local_host(cfg.split_host_port(a.strip())[0]) for a in addresses):
        _say("kafka: users and ACLs of an external cluster are left to its operator")
        return
    try:
        users = kafka_auth.ensure_users(settings)
        acls = kafka_auth.grant(settings)
    except RuntimeError as exc:
        raise StackError(str(exc)) from exc
    _say(f"kafka: {len(users)} role users and {acls} ACLs in place")


def _kafka_status(settings: Settings) -> ComponentStatus:
    paths = cfg.kafka_paths(settings)
    pid = _live_pid(paths.pid, str(paths.properties))
    if not _kafka_answers(settings):
        detail = f"broker pid {pid} not answering" if pid else "not running"
        return ComponentStatus("kafka", False, detail)
    topics = set(asyncio.run(_list_topics(settings)))
    missing = [t for t in settings.topics if t not in topics]
    owner = f"pid {pid}" if pid else "not started by us"
    detail = f"{settings.kafka_bootstrap} ({owner})"
    if missing:
        return ComponentStatus("kafka", False, f"{detail}; missing topics {', '.join(missing)}")
    return ComponentStatus("kafka", True, f"{detail}; {len(settings.topics)} topics")


# --------------------------------------------------------------------------- PostgreSQL


def _pg_ctl(settings: Settings, action: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        "pg_ctlcluster",
        "--skip-systemctl-redirect",
        settings.pg_cluster_version,
        settings.pg_cluster_name,
        action,
    ]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise StackError("postgres: pg_ctlcluster not found; run compose/bootstrap.sh") from exc


def ensure_pg_password(settings: Settings) -> Settings:
    """The settings with a PostgreSQL password: the one given, else for a local server the one
    in the password file, generated (mode 0600) the first time. `_up_postgres` then sets the
    role's password to it when the role does not log in with it (e.g. an older default)."""
    if settings.pg_password is not None or not cfg.is_local_host(settings.pg_host):
        return settings
    path = settings.pg_password_path
    if create_secret_file(path, secrets.token_urlsafe(32)):
        _say(f"postgres: generated the password of {settings.pg_user} in {path} (mode 0600)")
    try:
        password = read_secret_file(path)
    except ValueError as exc:
        raise StackError(f"postgres: {exc}") from exc
    return settings.model_copy(update={"pg_password": password})


def _up_postgres(settings: Settings) -> Settings:
    settings = ensure_pg_password(settings)
    cluster = f"{settings.pg_cluster_version}/{settings.pg_cluster_name}"
    if not cfg.is_local_host(settings.pg_host):
        _say(f"postgres: using external server {settings.pg_host}:{settings.pg_port}")
    elif _pg_ctl(settings, "status").returncode == 0:
        _say(f"postgres: cluster {cluster} running")
    else:
        result = _pg_ctl(settings, "start")
        if result.returncode != 0:
            raise StackError(f"postgres: starting cluster {cluster} failed:\n{_output(result)}")
        marker = cfg.postgres_marker(settings)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{cluster}\n")
        _say(f"postgres: cluster {cluster} started")
    if cfg.is_local_host(settings.pg_host) and not asyncio.run(_pg_connects(settings.pg_dsn)):
        _create_role_and_database(settings)
    deadline = time.monotonic() + PG_CONNECT_TIMEOUT
    while not asyncio.run(_pg_connects(settings.pg_dsn)):
        if time.monotonic() > deadline:
            raise StackError(
                f"postgres: cannot connect as {settings.pg_user} to {settings.pg_database} "
                f"on {settings.pg_host}:{settings.pg_port}"
            )
        time.sleep(0.25)
    applied = asyncio.run(apply_migrations(settings.pg_dsn))
    _say(f"postgres: migrations applied: {', '.join(applied)}" if applied else "postgres: ready")
    return settings


async def _pg_connects(dsn: str) -> bool:
    try:
        conn = await asyncpg.connect(dsn, timeout=5)
    except (OSError, TimeoutError, asyncpg.PostgresError):
        return False
    await conn.close()
    return True


def _create_role_and_database(settings: Settings) -> None:
    """Create (or fix the password of) our role and database as the postgres superuser."""
    if os.geteuid() != 0:
        raise StackError(
            f"postgres: cannot log in as {settings.pg_user}; creating the role and database "
            "needs root (runuser -u postgres psql)"
        )
    if settings.pg_password is None:
        raise StackError(f"postgres: no password for {settings.pg_user} (SANDSTREAM_PG_PASSWORD)")
    cmd = ["runuser", "-u", "postgres", "--", *cfg.psql_bootstrap_args(settings)]
    script = cfg.psql_bootstrap_input(settings.pg_password.get_secret_value(), os.urandom(16))
    result = subprocess.run(cmd, input=script, capture_output=True, text=True, cwd="/", check=False)
    if result.returncode != 0:
        raise StackError(f"postgres: creating role/database failed:\n{_output(result)}")
    _say(f"postgres: role {settings.pg_user} and database {settings.pg_database} ready")


def _postgres_status(settings: Settings) -> ComponentStatus:
    connects = asyncio.run(_pg_connects(settings.pg_dsn))
    where = f"{settings.pg_user}@{settings.pg_host}:{settings.pg_port}/{settings.pg_database}"
    if connects:
        ours = " (started by up)" if cfg.postgres_marker(settings).exists() else ""
        return ComponentStatus("postgres", True, f"{where}{ours}")
    return ComponentStatus("postgres", False, f"cannot connect to {where}")


# --------------------------------------------------------------------------- Podman


def podman_env(settings: Settings) -> dict[str, str]:
    """The environment for podman commands: ours points CONTAINERS_CONF at compose/podman."""
    return {**os.environ, "CONTAINERS_CONF": str(settings.containers_conf)}


def _podman_answers(settings: Settings) -> bool:
    if not settings.podman_socket_path.exists():
        return False
    try:
        with PodmanClient(base_url=settings.podman_url, timeout=3) as client:
            return client.ping()
    except Exception:
        return False


def _up_podman(settings: Settings) -> None:
    paths = cfg.podman_paths(settings)
    sock = settings.podman_socket_path
    pid = _live_pid(paths.pid, settings.podman_url)
    if _podman_answers(settings):
        _say(f"podman: service running ({f'pid {pid}' if pid else 'not started by us'})")
    elif pid is not None:  # started by a concurrent `up`, still coming up
        _wait_for(
            lambda: _podman_answers(settings),
            what="podman service",
            timeout=PODMAN_START_TIMEOUT,
            log=paths.log,
        )
    else:
        if len(str(sock).encode()) > 107:
            raise StackError(f"podman: socket path too long for a unix socket: {sock}")
        sock.parent.mkdir(parents=True, exist_ok=True)
        sock.unlink(missing_ok=True)
        started = time.monotonic()
        try:
            proc = _spawn(
                cfg.podman_service_command(settings),
                log=paths.log,
                pidfile=paths.pid,
                env=podman_env(settings),
            )
        except FileNotFoundError as exc:
            raise StackError("podman not found; run compose/bootstrap.sh") from exc
        _wait_for(
            lambda: _podman_answers(settings),
            what="podman service",
            timeout=PODMAN_START_TIMEOUT,
            log=paths.log,
            proc=proc,
        )
        _say(f"podman: service started (pid {proc.pid}) in {time.monotonic() - started:.1f}s")
    _ensure_image(settings)


def _image_exists(settings: Settings) -> bool:
    cmd = ["podman", "image", "exists", settings.sandbox_image]
    return subprocess.run(cmd, env=podman_env(settings), check=False).returncode == 0


def _ensure_image(settings: Settings) -> None:
    """Build the sandbox base image (static busybox and its applets) if it is missing."""
    if _image_exists(settings):
        return
    busybox = shutil.which("busybox")
    if busybox is None:
        raise StackError("podman: busybox not found; run compose/bootstrap.sh")
    applets = _run([busybox, "--list"], what="busybox --list").split()
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        _write_rootfs(rootfs, Path(busybox), applets)
        cmd = ["podman", "import", "--quiet"]
        for change in cfg.IMAGE_CHANGES:
            cmd += ["--change", change]
        _run(
            [*cmd, str(rootfs), settings.sandbox_image],
            what="podman import",
            env=podman_env(settings),
        )
    _say(f"podman: built image {settings.sandbox_image} ({len(applets)} busybox applets)")


def _write_rootfs(path: Path, busybox: Path, applets: list[str]) -> None:
    def entry(name: str, kind: bytes, mode: int = 0o755, link: str = "") -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.linkname, info.mtime = kind, mode, link, int(time.time())
        return info

    with tarfile.open(path, "w") as tar:
        for name in (*cfg.IMAGE_DIRS, "usr"):
            tar.addfile(entry(name, tarfile.DIRTYPE, 0o1777 if name == "tmp" else 0o755))
        info = entry("bin/busybox", tarfile.REGTYPE)
        info.size = busybox.stat().st_size
        with busybox.open("rb") as binary:
            tar.addfile(info, binary)
        for applet in sorted(set(applets) - {"busybox"}):
            tar.addfile(entry(f"bin/{applet}", tarfile.SYMTYPE, 0o777, "busybox"))
        for name, target in cfg.IMAGE_SYMLINKS.items():
            tar.addfile(entry(name, tarfile.SYMTYPE, 0o777, target))
        for name, text in cfg.IMAGE_FILES.items():
            data = text.encode()
            info = entry(name, tarfile.REGTYPE, 0o644)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _podman_status(settings: Settings) -> ComponentStatus:
    pid = _live_pid(cfg.podman_paths(settings).pid, settings.podman_url)
    if not _podman_answers(settings):
        return ComponentStatus("podman", False, f"no API at {settings.podman_url}")
    owner = f"pid {pid}" if pid else "not started by us"
    if not _image_exists(settings):
        return ComponentStatus(
            "podman", False, f"({owner}); image {settings.sandbox_image} missing"
        )
    return ComponentStatus(
        "podman", True, f"{settings.podman_url} ({owner}); {settings.sandbox_image}"
    )
