"""Kafka authentication's pure parts: the broker config and files, the clients' options."""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import pytest
from confluent_kafka.admin import AclBinding

from services.common.kafka_clients import (
    ROLES,
    KafkaCredentialsError,
    kafka_client_args,
    load_credentials,
)
from services.common.settings import PROJECT_ROOT, Settings
from services.localstack import config as cfg
from services.localstack import kafka_auth


def local(tmp_path: Path, **more: object) -> Settings:
    return Settings(
        state_dir=tmp_path,
        kafka_bootstrap="127.0.0.1:29092",
        kafka_controller_port=29093,
        **more,  # type: ignore[arg-type]
    )


def properties(text: str) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {k: v for k, v in pairs if not k.startswith("#")}


def test_the_broker_config_takes_sasl_only_and_denies_what_no_acl_allows(tmp_path: Path) -> None:
    settings = local(tmp_path)
    rendered = cfg.render_server_properties(cfg.KAFKA_PROPERTIES_TEMPLATE.read_text(), settings)
    text, jvm_options = kafka_auth.prepare_broker(settings, rendered)
    props = properties(text)
    assert props["listeners"] == "SASL_PLAINTEXT://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093"
    assert props["advertised.listeners"] == "SASL_PLAINTEXT://127.0.0.1:29092"
    protocols = props["listener.security.protocol.map"]
    assert protocols == "CONTROLLER:SASL_PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT"
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["authorizer.class.name"] == kafka_auth.AUTHORIZER
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["super.users"] == "User:sandstream-admin"
    assert props["log.dirs"] == str(tmp_path / "kafka" / "data")  # the rest as rendered
    admin = load_credentials(settings)["admin"]
    assert admin.password not in text
    jaas = kafka_auth.jaas_path(settings)
    assert jvm_options == [f"-Djava.security.auth.login.config={jaas}"]
    assert jaas.stat().st_mode & 0o777 == 0o600
    assert f'password="{admin.password}"' in jaas.read_text()


def test_a_tls_listener_takes_sasl_ssl_with_pem_stores_and_its_own_jaas_section(
    tmp_path: Path,
) -> None:
    settings = local(tmp_path)
    rendered = cfg.render_server_properties(cfg.KAFKA_PROPERTIES_TEMPLATE.read_text(), settings)
    tls = kafka_auth.ListenerTls(keystore=tmp_path / "keystore.pem", truststore=tmp_path / "ca.pem")
    text, _ = kafka_auth.prepare_broker(settings, rendered, tls)
    props = properties(text)
    assert props["listeners"] == "SASL_SSL://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093"
    assert props["advertised.listeners"] == "SASL_SSL://127.0.0.1:29092"
    assert props["inter.broker.listener.name"] == "SASL_SSL"
    assert props["listener.security.protocol.map"] == "CONTROLLER:SASL_PLAINTEXT,SASL_SSL:SASL_SSL"
    assert props["ssl.keystore.type"] == props["ssl.truststore.type"] == "PEM"
    assert props["ssl.keystore.location"] == str(tls.keystore)
    assert props["ssl.truststore.location"] == str(tls.truststore)
    assert kafka_auth.jaas_path(settings).read_text().startswith("sasl_ssl.KafkaServer {")


def test_plaintext_settings_leave_the_broker_config_as_rendered(tmp_path: Path) -> None:
    settings = local(tmp_path, kafka_security_protocol="PLAINTEXT")
    rendered = cfg.render_server_properties(cfg.KAFKA_PROPERTIES_TEMPLATE.read_text(), settings)
    assert kafka_auth.prepare_broker(settings, rendered) == (rendered, [])
    assert not settings.kafka_credentials_path.exists()
    assert "sasl_mechanism" not in kafka_client_args(settings, "api")


def test_the_format_step_gets_the_admin_credential_from_a_private_argument_file(
    tmp_path: Path,
) -> None:
    settings = local(tmp_path)
    cmd = cfg.kafka_java_command(settings, "kafka.tools.StorageTool", "format", "--config", "x")
    with kafka_auth.format_command(settings, cmd, "kafka.tools.StorageTool") as wrapped:
        argfile = Path(wrapped[-1].removeprefix("@"))
        assert wrapped[:-1] == cmd[: cmd.index("kafka.tools.StorageTool")]
        assert argfile.stat().st_mode & 0o777 == 0o600
        admin = load_credentials(settings)["admin"]
        assert f"password={admin.password}]" in argfile.read_text()
        assert all(admin.password not in arg for arg in wrapped)
    assert not argfile.exists()


def test_credentials_are_generated_once_per_role_into_a_private_file(tmp_path: Path) -> None:
    settings = local(tmp_path)
    first = kafka_auth.ensure_credentials(settings)
    assert set(first) == set(ROLES)
    assert settings.kafka_credentials_path.stat().st_mode & 0o777 == 0o600
    assert kafka_auth.ensure_credentials(settings) == first
    args = kafka_client_args(settings, "processor")
    assert args["security_protocol"] == "SASL_PLAINTEXT"
    assert args["sasl_mechanism"] == "SCRAM-SHA-512"
    assert args["sasl_plain_username"] == "sandstream-processor"
    assert args["sasl_plain_password"] == first["processor"].password


def test_a_credentials_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    settings = local(tmp_path)
    kafka_auth.ensure_credentials(settings)
    settings.kafka_credentials_path.chmod(0o640)
    with pytest.raises(KafkaCredentialsError, match="other users"):
        kafka_client_args(settings, "api")


def test_credentials_from_the_environment_win_and_name_only_the_roles_given(
    tmp_path: Path,
) -> None:
    given = {"api": {"username": "orders-api", "password": "s3cret"}}
    settings = local(
        tmp_path,
        kafka_security_protocol="SASL_SSL",
        kafka_credentials=json.dumps(given),
    )
    args = kafka_client_args(settings, "api")
    assert (args["sasl_plain_username"], args["sasl_plain_password"]) == ("orders-api", "s3cret")
    assert isinstance(args["ssl_context"], ssl.SSLContext)
    with pytest.raises(KafkaCredentialsError, match="'processor'"):
        kafka_client_args(settings, "processor")
    assert "s3cret" not in repr(load_credentials(settings))
    assert "SANDSTREAM_KAFKA_CREDENTIALS" not in settings.as_env()


def test_malformed_credentials_name_the_expected_shape(tmp_path: Path) -> None:
    settings = local(tmp_path, kafka_credentials='{"api": "s3cret"}')
    with pytest.raises(KafkaCredentialsError, match="username"):
        kafka_client_args(settings, "api")


def test_a_storage_formatted_without_authentication_is_named_not_waited_on(
    tmp_path: Path,
) -> None:
    settings = local(tmp_path)
    problem = kafka_auth.storage_problem(settings)
    assert problem is not None and "formatted without authentication" in problem
    kafka_auth.storage_formatted(settings)
    assert kafka_auth.storage_problem(settings) is None
    plaintext = local(tmp_path / "other", kafka_security_protocol="PLAINTEXT")
    assert kafka_auth.storage_problem(plaintext) is None


def test_security_md_lists_the_acl_commands_of_the_default_settings(tmp_path: Path) -> None:
    doc = (PROJECT_ROOT / "docs" / "security.md").read_text()
    commands = kafka_auth.acl_commands(Settings(state_dir=tmp_path))
    missing = [c for c in commands if c not in doc.splitlines()]
    assert not missing, "docs/security.md lacks: " + "\n".join(missing)


def test_every_kafka_client_is_built_through_kafka_client_args() -> None:
    """A client given ``bootstrap_servers`` by hand would connect without its role's login
    (and be refused by the broker); only services/common/kafka_clients.py names it."""
    builder = PROJECT_ROOT / "services" / "common" / "kafka_clients.py"
    needle = "bootstrap_servers" + "="  # split, so that this line is no hit itself
    found = [
        f"{path.relative_to(PROJECT_ROOT)}:{n}"
        for package in ("events", "projections", "drivers", "services", "tests")
        for path in sorted((PROJECT_ROOT / package).rglob("*.py"))
        if path != builder
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if needle in line
    ]
    assert not found, "build these through kafka_client_args(settings, role): " + str(found)


def test_granting_waits_until_the_broker_lists_every_new_acl() -> None:
    """The controller acknowledges an ACL before a broker enforces it; ``grant`` returns only
    once the broker lists it (a processor started in between was refused its topics)."""
    wanted = kafka_auth._bindings(Settings())[:3]
    answers = iter([[], wanted[:1], [*wanted[:2], wanted[0]], wanted])
    calls = []

    def describe() -> list[AclBinding]:
        calls.append(1)
        return next(answers)

    kafka_auth.wait_until_described(describe, wanted)
    assert len(calls) == 4


def test_acls_never_in_force_fail_after_the_deadline() -> None:
    wanted = kafka_auth._bindings(Settings())[:1]
    with pytest.raises(RuntimeError, match="not in force"):
        kafka_auth.wait_until_described(lambda: [], wanted, timeout=0.2)
