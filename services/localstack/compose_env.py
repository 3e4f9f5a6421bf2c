"""The variables compose/docker-compose.yml reads, for the local stack (or an isolated
environment of it): endpoints, names, ports, and each role's secrets.

    eval "$(python -m services.localstack.compose_env)"
    podman-compose -f compose/docker-compose.yml up -d

Each role's Kafka credential (``SANDSTREAM_KAFKA_<ROLE>``: its own principal only, as JSON) comes
from the local stack's credentials file, the PostgreSQL password from its password file, and the
credentials key from the key file `sandstream up` uses (created if missing). ``CONTAINERS_CONF``
points podman at the project's configuration, as for the rest of the local stack.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from services.common.credentials import create_key_file
from services.common.kafka_clients import load_credentials
from services.common.secret_files import read_secret_file
from services.common.settings import Settings, load_settings
from services.localstack.image import image_reference, project_version

COMPOSE_ROLES = ("admin", "api", "processor", "executor", "watcher", "scheduler")


@dataclass(frozen=True)
class ComposePorts:
    api: int = 8787
    openshell: int = 8788
    health: int = 9101  # api, processor, executor, watcher, scheduler on this and the next four

    def by_role(self) -> dict[str, int]:
        return {r: self.health + i for i, r in enumerate(COMPOSE_ROLES[1:])}


def compose_env(
    settings: Settings, credentials: Mapping[str, str], ports: ComposePorts = ComposePorts()
) -> dict[str, str]:
    """The variables; ``credentials`` holds the secrets (``kafka:<role>``, ``pg``, ``key``)."""
    s = settings
    env = {
        "SANDSTREAM_IMAGE": image_reference(project_version()),
        "SANDSTREAM_KAFKA_BOOTSTRAP": s.kafka_bootstrap,
        "SANDSTREAM_KAFKA_SECURITY_PROTOCOL": s.kafka_security_protocol,
        "SANDSTREAM_KAFKA_PARTITIONS": str(s.kafka_partitions),
        "SANDSTREAM_TOPIC_COMMANDS": s.topic_commands,
        "SANDSTREAM_TOPIC_OBSERVATIONS": s.topic_observations,
        "SANDSTREAM_TOPIC_EVENTS": s.topic_events,
        "SANDSTREAM_TOPIC_DEADLETTER": s.topic_deadletter,
        "SANDSTREAM_PROCESSOR_GROUP": s.processor_group,
        "SANDSTREAM_EXECUTOR_GROUP": s.executor_group,
        "SANDSTREAM_PG_HOST": s.pg_host,
        "SANDSTREAM_PG_PORT": str(s.pg_port),
        "SANDSTREAM_PG_SCHEMA": s.pg_schema,
        "SANDSTREAM_PG_SSLMODE": s.pg_sslmode,
        "SANDSTREAM_PG_PASSWORD": credentials["pg"],
        "SANDSTREAM_CREDENTIALS_KEY": credentials["key"],
        "SANDSTREAM_PODMAN_SOCKET": str(s.podman_socket_path),
        "SANDSTREAM_API_PORT": str(ports.api),
        "SANDSTREAM_OPENSHELL_PORT": str(ports.openshell),
    }
    for role in COMPOSE_ROLES:
        env[f"SANDSTREAM_KAFKA_{role.upper()}"] = credentials[f"kafka:{role}"]
    for role, port in ports.by_role().items():
        env[f"SANDSTREAM_HEALTH_PORT_{role.upper()}"] = str(port)
    return env


def local_credentials(settings: Settings) -> dict[str, str]:
    """The local stack's secrets, as compose_env takes them."""
    found = load_credentials(settings)
    secrets = {
        f"kafka:{role}": json.dumps(
            {role: {"username": found[role].username, "password": found[role].password}}
        )
        for role in COMPOSE_ROLES
    }
    password = settings.pg_password.get_secret_value() if settings.pg_password else ""
    create_key_file(settings.credentials_key_path)
    key = read_secret_file(settings.credentials_key_path)
    assert key is not None  # just created if it was missing
    return secrets | {"pg": password, "key": key.get_secret_value()}


def main() -> None:
    settings = load_settings()
    # and podman's own configuration for this machine (runc, cgroupfs: compose/podman/)
    env = compose_env(settings, local_credentials(settings)) | {
        "CONTAINERS_CONF": str(settings.containers_conf)
    }
    sys.stdout.write("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))


if __name__ == "__main__":
    main()
