"""Authentication and ACLs of the local broker: SASL/SCRAM, one principal per role.

The broker's client listener takes SASL_PLAINTEXT with SCRAM-SHA-512 only; the StandardAuthorizer
denies what no ACL allows. The admin principal (a super user) is written into the storage when
it is formatted, so the broker can authenticate its own inter-broker connections; the
controller listener (loopback, broker to controller) uses SASL/PLAIN with the admin password
from the JAAS file. Every other role's SCRAM user is created with the admin API after start,
and its ACLs are granted on the settings' topic and group names (``grant``; a test environment
grants them on its own names and revokes them afterwards). Passwords are generated once into
the credentials file (mode 0600); the JAAS file and the format step's argument file are 0600
too, so no password is on a command line. docs/security.md and docs/adr/ say why.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialAlteration,
    UserScramCredentialUpsertion,
)

from services.common.kafka_clients import (
    ROLES,
    SASL_PROTOCOLS,
    Credential,
    KafkaCredentialsError,
    Role,
    default_username,
    kafka_client_args,
    load_credentials,
)
from services.common.secret_files import replace_secret_file
from services.common.settings import Settings, load_settings
from services.localstack.config import kafka_paths, set_properties

SCRAM_ITERATIONS = 8192
ADMIN_TIMEOUT = 30.0
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
SCRAM_LOGIN = "org.apache.kafka.common.security.scram.ScramLoginModule"
PLAIN_LOGIN = "org.apache.kafka.common.security.plain.PlainLoginModule"


def enabled(settings: Settings) -> bool:
    return settings.kafka_security_protocol in SASL_PROTOCOLS


# --------------------------------------------------------------------------- passwords


def ensure_credentials(settings: Settings) -> dict[str, Credential]:
    """The credentials file with a generated password for every role (missing ones added)."""
    path = settings.kafka_credentials_path
    found = load_credentials(settings) if path.exists() else {}
    missing = [r for r in ROLES if r not in found]
    if missing:
        for role in missing:
            found[role] = Credential(default_username(role), secrets.token_urlsafe(24))
        entries = {r: {"username": c.username, "password": c.password} for r, c in found.items()}
        replace_secret_file(path, json.dumps(entries, indent=2) + "\n")
    return found


# --------------------------------------------------------------------------- broker config


def _get_property(text: str, key: str) -> str:
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() == key:
            return value.strip()
    raise KeyError(key)


@dataclass(frozen=True)
class ListenerTls:
    """A TLS client listener's PEM files: the broker's private key followed by its certificate
    chain, and the CA it trusts (for its own inter-broker connections to that listener)."""

    keystore: Path
    truststore: Path


def secure_properties(text: str, admin: Credential, tls: ListenerTls | None = None) -> str:
    """A rendered broker config with its PLAINTEXT client listener turned into SASL_PLAINTEXT
    (SASL_SSL with ``tls``; SCRAM-SHA-512), the controller listener into SASL_PLAINTEXT (PLAIN),
    and the authorizer."""
    client = "SASL_SSL" if tls else "SASL_PLAINTEXT"
    sasl = re.compile(r"(?<![A-Z_])PLAINTEXT(?=://)")
    pem = {
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(tls.keystore),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(tls.truststore),
    } if tls else {}  # fmt: skip
    return set_properties(
        text,
        {
            "listeners": sasl.sub(client, _get_property(text, "listeners")),
            "advertised.listeners": sasl.sub(client, _get_property(text, "advertised.listeners")),
            "inter.broker.listener.name": client,
            "listener.security.protocol.map": f"CONTROLLER:SASL_PLAINTEXT,{client}:{client}",
            "sasl.enabled.mechanisms": "SCRAM-SHA-512",
            "sasl.mechanism.inter.broker.protocol": "SCRAM-SHA-512",
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "sasl.mechanism.controller.protocol": "PLAIN",
            "authorizer.class.name": AUTHORIZER,
            "allow.everyone.if.no.acl.found": "false",
            "super.users": f"User:{admin.username}",
        }
        | pem,
        header="Authentication and ACLs (services/localstack/kafka_auth.py)",
    )


def _quoted(value: str) -> str:
    """A double-quoted string as JAAS files and java's argument files read them."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def jaas_config(admin: Credential, client: str = "SASL_PLAINTEXT") -> str:
    """The broker's JAAS file: the admin's SCRAM login for inter-broker connections on the
    client listener (named ``client``), PLAIN (with the one accepted user) on the controller
    listener."""
    user, password = _quoted(admin.username), _quoted(admin.password)
    return (
        f"{client.lower()}.KafkaServer {{\n"
        f"  {SCRAM_LOGIN} required\n    username={user} password={password};\n}};\n"
        "controller.KafkaServer {\n"
        f"  {PLAIN_LOGIN} required\n    username={user} password={password}\n"
        f"    user_{admin.username}={password};\n}};\n"
    )


def jaas_path(settings: Settings) -> Path:
    return kafka_paths(settings).home / "jaas.conf"


def prepare_broker(
    settings: Settings, properties: str, tls: ListenerTls | None = None
) -> tuple[str, list[str]]:
    """The broker config to write and the JVM options to add, with the JAAS file written; the
    client listener takes SASL_SSL with ``tls``, else SASL_PLAINTEXT."""
    if not enabled(settings):
        return properties, []
    admin = ensure_credentials(settings)["admin"]
    client = "SASL_SSL" if tls else "SASL_PLAINTEXT"
    replace_secret_file(jaas_path(settings), jaas_config(admin, client))
    option = f"-Djava.security.auth.login.config={jaas_path(settings)}"
    return secure_properties(properties, admin, tls), [option]


def with_jvm_options(cmd: list[str], options: Sequence[str]) -> list[str]:
    """``cmd`` (a java command line) with ``options`` right after the java executable."""
    return [cmd[0], *options, *cmd[1:]]


def _formatted_marker(settings: Settings) -> Path:
    return kafka_paths(settings).home / "formatted-with-admin"


def storage_problem(settings: Settings) -> str | None:
    """Why the formatted storage cannot serve these settings (no admin user in it), if so."""
    if not enabled(settings) or _formatted_marker(settings).exists():
        return None
    return (
        f"kafka: the broker's storage ({kafka_paths(settings).data}) was formatted without "
        "authentication, so it has no admin user to log in with. Either start over with an "
        "empty log (`down`, remove that directory, `up`; the log is lost) or keep running "
        "without authentication (SANDSTREAM_KAFKA_SECURITY_PROTOCOL=PLAINTEXT); "
        "docs/security.md"
    )


def storage_formatted(settings: Settings) -> None:
    """Note that the storage was formatted with the admin's credential in it."""
    if enabled(settings):
        _formatted_marker(settings).parent.mkdir(parents=True, exist_ok=True)
        _formatted_marker(settings).write_text(ensure_credentials(settings)["admin"].username)


@contextmanager
def format_command(settings: Settings, cmd: list[str], main_class: str) -> Iterator[list[str]]:
    """The storage format command ``cmd`` with the admin's SCRAM credential added: the main
    class and its arguments move into a 0600 argument file (java's @file), removed after."""
    if not enabled(settings):
        yield cmd
        return
    admin = ensure_credentials(settings)["admin"]
    at = cmd.index(main_class)
    scram = f"SCRAM-SHA-512=[name={admin.username},password={admin.password}]"
    argfile = kafka_paths(settings).home / "format.args"
    args = [*cmd[at:], "--add-scram", scram]
    replace_secret_file(argfile, "\n".join(_quoted(a) for a in args) + "\n")
    try:
        yield [*cmd[:at], f"@{argfile}"]
    finally:
        argfile.unlink(missing_ok=True)


# --------------------------------------------------------------------------- ACLs


@dataclass(frozen=True)
class Grant:
    """Role ``role`` may do ``operation`` on the topic or group ``name``."""

    role: Role
    resource: ResourceType
    name: str
    operation: AclOperation


def role_grants(settings: Settings) -> list[Grant]:
    """What each role may do on the settings' topics and groups, and nothing more. (Write and
    Read imply Describe; an idempotent producer needs Write on a topic, not IdempotentWrite.)"""
    s = settings
    topic, group = ResourceType.TOPIC, ResourceType.GROUP
    read, write, describe = AclOperation.READ, AclOperation.WRITE, AclOperation.DESCRIBE
    grants: list[tuple[Role, ResourceType, str, AclOperation]] = [
        ("api", topic, s.topic_commands, write),
        ("api", topic, s.topic_observations, describe),  # readiness: the inputs' end offsets
        ("provider-sync", topic, s.topic_commands, write),
        ("processor", topic, s.topic_commands, read),
        ("processor", topic, s.topic_commands, write),  # a claim's next step (docs/adr/0009)
        ("processor", topic, s.topic_observations, read),
        ("processor", topic, s.topic_events, write),
        ("processor", topic, s.topic_deadletter, write),
        ("processor", topic, s.topic_checkpoints, write),
        ("processor", group, s.processor_group, read),
        ("executor", topic, s.topic_events, read),
        ("executor", topic, s.topic_observations, write),  # the driver calls' outcomes
        ("executor", group, s.executor_group, read),
        ("watcher", topic, s.topic_observations, write),
        ("scheduler", topic, s.topic_observations, write),
        ("scheduler", topic, s.topic_commands, write),  # the pool controller's creates, deletes
        *[("audit", topic, t, read) for t in s.topics],
        ("audit", group, s.processor_group, describe),  # is a processor running?
    ]
    return [Grant(*g) for g in grants]


def usernames(settings: Settings) -> dict[Role, str]:
    """Each role's username: from the credentials where they are readable, else the default."""
    try:
        found = load_credentials(settings)
    except KafkaCredentialsError:
        found = {}
    return {r: found[r].username if r in found else default_username(r) for r in ROLES}


def acl_commands(settings: Settings) -> list[str]:
    """The role grants as ``kafka-acls.sh`` commands, for a cluster sandstream does not run."""
    users = usernames(settings)
    by_resource: dict[tuple[Role, ResourceType, str], list[str]] = {}
    for g in role_grants(settings):
        by_resource.setdefault((g.role, g.resource, g.name), []).append(g.operation.name.title())
    option = {ResourceType.TOPIC: "--topic", ResourceType.GROUP: "--group"}
    return [
        f"kafka-acls.sh --bootstrap-server $BOOTSTRAP --command-config admin.properties --add "
        f"--allow-principal User:{users[role]} "
        + " ".join(f"--operation {op}" for op in operations)
        + f" {option[resource]} {name}"
        for (role, resource, name), operations in by_resource.items()
    ]


def main() -> None:
    """Print the ACL commands for the current settings (``python -m
    services.localstack.kafka_auth``)."""
    print("\n".join(acl_commands(load_settings())))


def _bindings(settings: Settings) -> list[AclBinding]:
    users = load_credentials(settings)
    return [
        AclBinding(
            g.resource,
            g.name,
            ResourcePatternType.LITERAL,
            f"User:{users[g.role].username}",
            "*",
            g.operation,
            AclPermissionType.ALLOW,
        )
        for g in role_grants(settings)
        if g.role in users
    ]


# aiokafka's option names -> librdkafka's
_CONFLUENT_NAMES = {
    "bootstrap_servers": "bootstrap.servers",
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanism",
    "sasl_plain_username": "sasl.username",
    "sasl_plain_password": "sasl.password",
}


def admin_config(settings: Settings, role: Role = "admin") -> dict[str, Any]:
    """confluent-kafka's client config for ``role`` (it has the admin API aiokafka lacks): the
    same connection as ``kafka_client_args`` in librdkafka's words."""
    args = kafka_client_args(settings, role)
    config = {name: args[key] for key, name in _CONFLUENT_NAMES.items() if key in args}
    if "ssl_context" in args and settings.kafka_ssl_cafile:
        config["ssl.ca.location"] = str(settings.kafka_ssl_cafile)
    return config


def _wait_all(futures: dict[Any, Any], what: str) -> None:
    for key, future in futures.items():
        try:
            future.result(timeout=ADMIN_TIMEOUT)
        except KafkaException as exc:
            raise RuntimeError(f"kafka: {what} {key}: {exc.args[0]}") from exc


def ensure_users(settings: Settings) -> list[str]:
    """Create (or reset to the credentials file's password) every role's SCRAM user."""
    users = ensure_credentials(settings)
    upserts: list[UserScramCredentialAlteration] = [
        UserScramCredentialUpsertion(
            c.username,
            ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS),
            c.password.encode(),
        )
        for role, c in users.items()
        if role != "admin"  # in the storage since it was formatted; the broker logs in with it
    ]
    admin = AdminClient(admin_config(settings))
    _wait_all(admin.alter_user_scram_credentials(upserts), "creating SCRAM user")
    return [c.username for role, c in users.items() if role != "admin"]


_MATCH_ANY: Any = None  # a filter's None matches any value (the stubs type these as str)
EVERY_ACL = AclBindingFilter(
    ResourceType.ANY,
    _MATCH_ANY,
    ResourcePatternType.ANY,
    _MATCH_ANY,
    _MATCH_ANY,
    AclOperation.ANY,
    AclPermissionType.ANY,
)


def grant(settings: Settings) -> int:
    """Create the roles' ACLs on the settings' names (creating an existing one is a no-op),
    and return once the broker enforces them."""
    bindings = _bindings(settings)
    admin = AdminClient(admin_config(settings))
    _wait_all(admin.create_acls(bindings), "creating ACL")
    wait_until_described(lambda: admin.describe_acls(EVERY_ACL).result(ADMIN_TIMEOUT), bindings)
    return len(bindings)


def wait_until_described(
    describe: Callable[[], list[AclBinding]],
    bindings: list[AclBinding],
    timeout: float = ADMIN_TIMEOUT,
) -> None:
    """Poll until ``describe`` lists every binding. The controller acknowledges a created ACL
    once it is in the metadata log; a broker's authorizer applies it when it replays that log,
    a moment later, and a client that asks in between is refused (TOPIC_AUTHORIZATION_FAILED)."""
    _poll_until(
        lambda: set(bindings) <= set(describe()),
        f"kafka: {len(bindings)} ACLs created but not in force after {timeout}s",
        timeout,
    )


def _poll_until(done: Callable[[], bool], failure: str, timeout: float) -> None:
    """Return once ``done()``; RuntimeError(``failure``) after ``timeout`` seconds. (The
    admin API has nothing to wait on but its answers.)"""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(0.05)  # the poll interval; the deadline above bounds the wait


def matching(binding: AclBinding) -> AclBindingFilter:
    """The filter that matches ``binding`` alone."""
    b = binding
    return AclBindingFilter(
        b.restype, b.name, b.resource_pattern_type, b.principal, b.host, b.operation,
        b.permission_type,
    )  # fmt: skip


def delete_acls(
    settings: Settings, filters: list[AclBindingFilter], timeout: float = ADMIN_TIMEOUT
) -> None:
    """Delete the ACLs ``filters`` match, and return once the broker lists none of them."""
    admin = AdminClient(admin_config(settings))
    _wait_all(admin.delete_acls(filters), "deleting ACL")
    _poll_until(
        lambda: not any(admin.describe_acls(f).result(timeout) for f in filters),
        f"kafka: {len(filters)} ACL filters deleted but still listed after {timeout}s",
        timeout,
    )


def revoke(settings: Settings) -> None:
    """Delete the ACLs ``grant`` created for these settings, and return once the broker lists
    none of them (a deletion is applied through the metadata log: a describe right after the
    delete's answer could still list them, and a prune's check failed in CI on that)."""
    delete_acls(settings, [matching(b) for b in _bindings(settings)])


if __name__ == "__main__":
    main()
