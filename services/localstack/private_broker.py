"""A single-node Kafka of one's own, for tests that must lose their broker.

The shared local broker is never stopped for a test; a test that needs a broker to go away
starts this one from the same jars (the cache dir) with its own state dir and ports. It can
advertise another address than it listens on (a TCP proxy the test controls, to cut every
client connection at once).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
from pathlib import Path
from typing import Any

from services.common.settings import Settings
from services.localstack import config as cfg
from services.localstack import kafka_auth, kafka_broker
from services.localstack.processes import spawn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def private_settings(base: Settings, state_dir: Path, **more: Any) -> Settings:
    """``base`` with a state dir and free ports of its own and a small heap (and ``more``):
    where a private broker keeps its data and listens."""
    update = {
        "state_dir": state_dir,
        "kafka_bootstrap": f"127.0.0.1:{free_port()}",
        "kafka_controller_port": free_port(),
        "kafka_heap": "256m",
    }
    return base.model_copy(update=update | more)


def start(
    settings: Settings,
    *,
    advertised: str | None = None,
    tls: kafka_auth.ListenerTls | None = None,
) -> subprocess.Popen[bytes]:
    """Start a broker listening on ``settings.kafka_bootstrap`` (and its controller port) with
    its data under ``settings.state_dir``; clients are told to connect to ``advertised``. With
    ``tls`` its client listener takes SASL_SSL instead of SASL_PLAINTEXT."""
    paths = cfg.kafka_paths(settings)
    paths.home.mkdir(parents=True, exist_ok=True)
    kafka_broker.resolve_libs(settings)
    properties = cfg.render_server_properties(cfg.KAFKA_PROPERTIES_TEMPLATE.read_text(), settings)
    if advertised is not None:
        properties = properties.replace(
            f"advertised.listeners=PLAINTEXT://{settings.kafka_bootstrap}",
            f"advertised.listeners=PLAINTEXT://{advertised}",
        )
    properties, jvm_options = kafka_auth.prepare_broker(settings, properties, tls)
    paths.properties.write_text(properties)
    kafka_broker.format_storage(settings)
    return spawn(
        kafka_auth.with_jvm_options(
            cfg.kafka_java_command(settings, "kafka.Kafka", str(paths.properties)), jvm_options
        ),
        log=paths.log,
        pidfile=paths.pid,
    )


def wait_ready(settings: Settings, proc: subprocess.Popen[bytes]) -> None:
    """Block until the broker answers a metadata request at ``settings.kafka_bootstrap``, then
    create the roles' users (as the local stack's `up` does)."""
    kafka_broker.wait(settings, proc)
    kafka_broker.ensure_auth(settings)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
