"""Start, stop and inspect the local stack: Kafka (single-node KRaft), PostgreSQL 15, Podman.

    python -m services.localstack up | down | status

``up`` is idempotent: it starts only what is not running (a second ``up`` restarts nothing),
creates the Kafka topics, the PostgreSQL role and database, applies the SQL migrations and
builds the sandbox base image when they are missing. ``down`` stops what ``up`` started:
the broker and the Podman API service by their pid files, the PostgreSQL cluster only when
``up`` had to start it. Containers are the drivers' business and are left alone.

This module orchestrates; each component is its own module (``kafka_broker``, ``postgres``,
``podman_service``, sharing ``processes``). Runtime files (configs, data, logs, pid files, the
Podman socket) live under ``settings.state_dir``; downloaded broker jars under
``settings.cache_dir``.
"""

from __future__ import annotations

import time

from services.common.settings import Settings
from services.localstack import kafka_broker, podman_service, postgres
from services.localstack.kafka_broker import ensure_topics
from services.localstack.processes import ComponentStatus, StackError, say

# What other code uses of the stack, besides up, down and status.
__all__ = ["ComponentStatus", "StackError", "down", "ensure_topics", "status", "up"]


def up(settings: Settings) -> Settings:
    """Bring every component up; do nothing for those already running. The settings returned
    carry the PostgreSQL password (generated on the first `up` of a local server)."""
    started = time.monotonic()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    broker = kafka_broker.start(settings)  # the JVM boots while PostgreSQL and Podman come up
    settings = postgres.up(settings)
    podman_service.up(settings)
    kafka_broker.wait(settings, broker)
    ensure_topics(settings)
    kafka_broker.ensure_auth(settings)
    say(f"up in {time.monotonic() - started:.1f}s")
    return settings


def down(settings: Settings) -> None:
    """Stop what `up` started and leave nothing of ours running."""
    kafka_broker.stop(settings)
    podman_service.stop(settings)
    postgres.stop(settings)


def status(settings: Settings) -> list[ComponentStatus]:
    """Print and return the state of each component."""
    components = [
        kafka_broker.status(settings),
        postgres.status(settings),
        podman_service.status(settings),
    ]
    show(components)
    return components


def show(components: list[ComponentStatus]) -> None:
    for c in components:
        print(f"{c.name:<10} {'up' if c.running else 'DOWN':<5} {c.detail}", flush=True)
