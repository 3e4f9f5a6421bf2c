"""The Kafka principal each part of sandstream connects as, and the aiokafka options for it.

Every Kafka client in the code base is built from ``kafka_client_args(settings, role)``: the
bootstrap servers, the security protocol (SASL_PLAINTEXT with SCRAM-SHA-512 on the local
stack; SASL_SSL with a CA file on a real cluster) and the role's username and password. The
passwords come from SANDSTREAM_KAFKA_CREDENTIALS (JSON) when set, else from the credentials
file (mode 0600) that the local stack writes once. docs/security.md lists what each role may
do; services/localstack/kafka_auth.py grants exactly that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, get_args

from aiokafka.helpers import create_ssl_context

from services.common.kafka_requests import count_requests
from services.common.secret_files import read_secret_file
from services.common.settings import Settings

count_requests()  # every client built from these arguments is counted (/metrics)

Role = Literal[
    "admin",  # topics, users and ACLs: the local stack's setup, test environments
    "api",  # the HTTP and OpenShell APIs: write commands
    "provider-sync",  # the provider-sync controller: write commands
    "processor",  # read the inputs, write the events and dead letters
    "executor",  # read the events, write the driver calls' outcomes (observations)
    "watcher",  # the driver watcher and the reconcile loop: write observations
    "scheduler",  # DeadlineDue observations; the pool controller's commands
    "audit",  # read-only tools: audit, rebuild, log identity, benchmarks' readers
]
ROLES: tuple[Role, ...] = get_args(Role)
SASL_PROTOCOLS = ("SASL_PLAINTEXT", "SASL_SSL")
TLS_PROTOCOLS = ("SSL", "SASL_SSL")


class KafkaCredentialsError(RuntimeError):
    """No usable username and password for a role: missing, malformed, or readable by others."""


@dataclass(frozen=True)
class Credential:
    username: str
    password: str

    def __repr__(self) -> str:
        return f"Credential({self.username!r}, <password>)"


def default_username(role: Role) -> str:
    return f"sandstream-{role}"


def parse_credentials(text: str, where: str) -> dict[str, Credential]:
    """``{"role": {"username": ..., "password": ...}, ...}`` as Credentials by role."""
    try:
        data = json.loads(text)
        return {
            role: Credential(str(entry["username"]), str(entry["password"]))
            for role, entry in data.items()
        }
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise KafkaCredentialsError(
            f'{where}: expected {{"ROLE": {{"username": ..., "password": ...}}}}'
        ) from exc


def load_credentials(settings: Settings) -> dict[str, Credential]:
    """The credentials by role: from the environment if set there, else from the file."""
    if settings.kafka_credentials is not None:
        given = settings.kafka_credentials.get_secret_value()
        return parse_credentials(given, "SANDSTREAM_KAFKA_CREDENTIALS")
    path = settings.kafka_credentials_path
    try:
        secret = read_secret_file(path)
    except ValueError as exc:  # readable by others
        raise KafkaCredentialsError(str(exc)) from None
    if secret is None:
        raise KafkaCredentialsError(
            f"{path}: no Kafka credentials (the local stack's `up` writes them; or set "
            "SANDSTREAM_KAFKA_CREDENTIALS)"
        )
    return parse_credentials(secret.get_secret_value(), str(path))


def credential(settings: Settings, role: Role) -> Credential:
    found = load_credentials(settings).get(role)
    if found is None:
        raise KafkaCredentialsError(f"no Kafka credentials for role {role!r}")
    return found


def kafka_client_args(
    settings: Settings, role: Role, client_id: str | None = None
) -> dict[str, Any]:
    """Keyword arguments for an aiokafka producer, consumer, admin or plain client that
    connects as ``role``, with ``client_id`` (default ``sandstream-<role>``): the name the
    broker's logs and ``sandstream_kafka_requests_total`` know it by."""
    protocol = settings.kafka_security_protocol
    args: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap,
        "security_protocol": protocol,
        "client_id": client_id or default_username(role),
    }
    if protocol in TLS_PROTOCOLS:
        cafile = str(settings.kafka_ssl_cafile) if settings.kafka_ssl_cafile else None
        args["ssl_context"] = create_ssl_context(cafile=cafile)
    if protocol in SASL_PROTOCOLS:
        found = credential(settings, role)
        args |= {
            "sasl_mechanism": settings.kafka_sasl_mechanism,
            "sasl_plain_username": found.username,
            "sasl_plain_password": found.password,
        }
    return args
