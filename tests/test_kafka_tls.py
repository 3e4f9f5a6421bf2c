"""Kafka over TLS: the clients against a real SASL_SSL broker (SCRAM-SHA-512).

The shared local broker takes SASL_PLAINTEXT only; this module starts a broker of its own (from
the same jars) whose client listener takes SASL_SSL with a certificate for 127.0.0.1 that a CA
made here signs, and points the settings at it with that CA as ``kafka_ssl_cafile``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import factories as f
import pytest
import tlskit
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from harness import eventually
from role_processes import roles_env

from events.codec import EVENTS, decode
from services.api.readmodel import await_outcome
from services.common.entrypoint import EXIT_START_FAILED, EXIT_STOPPED
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.localstack import kafka_auth, kafka_broker, private_broker, stack


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Settings whose Kafka is a private SASL_SSL broker, its role users created."""
    state_dir = tmp_path_factory.mktemp("tls-broker")
    issued = tlskit.issue_for_localhost(state_dir, dns_names=())  # 127.0.0.1 only
    shared = Settings()
    settings = private_broker.private_settings(
        shared,
        state_dir,
        pg_password_file=shared.pg_password_path,  # role processes read it there
        kafka_security_protocol="SASL_SSL",
        kafka_ssl_cafile=issued.ca,
    )
    tls = kafka_auth.ListenerTls(keystore=tlskit.pem_keystore(issued), truststore=issued.ca)
    proc = private_broker.start(settings, tls=tls)
    try:
        private_broker.wait_ready(settings, proc)  # users and ACLs through the admin API
        yield settings
    finally:
        private_broker.stop(proc)


async def test_the_processor_role_consumes_commands_and_publishes_events_over_sasl_ssl(
    tls_broker: Settings, tmp_path: Path
) -> None:
    """`sandstream processor`, given the broker and the CA through its environment, logs in
    as its role: a CreateSandbox command becomes a row and a SandboxCreated event."""
    async with roles_env(tmp_path, partitions=1, base=tls_broker) as roles:
        env = roles.env
        assert roles.variables()["SANDSTREAM_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
        processor = roles.start("processor")
        await processor.ready()
        async with await env.publisher() as pub:
            await pub.publish(f.create("tls", command_id="c-tls"))
            outcome = await await_outcome(env.pool, "c-tls", timeout=30)
        assert outcome is not None and outcome.accepted
        rows = await env.fetch("SELECT phase FROM sandboxes WHERE key = 'tls'")
        assert [r["phase"] for r in rows] == ["Provisioning"]
        events = await eventually(
            lambda: env.read_topic(env.settings.topic_events),
            lambda rs: len(rs) >= 1,
            what="the SandboxCreated event",
        )
        assert [decode(EVENTS, r.value).type for r in events] == ["SandboxCreated"]
        assert processor.terminate() == EXIT_STOPPED


async def test_a_role_that_trusts_another_ca_fails_at_start_naming_the_verification(
    tls_broker: Settings, tmp_path: Path
) -> None:
    """Not a hang: the processor ends with the start-failure code, its log names why."""
    other = tlskit.make_ca(tmp_path, "another CA")
    async with roles_env(tmp_path, partitions=1, base=tls_broker) as roles:
        processor = roles.start("processor", env={"SANDSTREAM_KAFKA_SSL_CAFILE": str(other.path)})
        assert processor.exit_code() == EXIT_START_FAILED
        assert "CERTIFICATE_VERIFY_FAILED" in processor.log.read_text()


async def test_clients_refuse_a_broker_whose_certificate_does_not_name_the_host_they_dialled(
    tls_broker: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """The certificate names 127.0.0.1 only: reached as localhost, with the right CA, aiokafka
    (every role) and librdkafka (the admin API's users and ACLs) both refuse it."""
    port = tls_broker.kafka_bootstrap.rsplit(":", 1)[1]
    by_name = tls_broker.model_copy(update={"kafka_bootstrap": f"localhost:{port}"})
    admin = AIOKafkaAdminClient(**kafka_client_args(by_name, "admin"), request_timeout_ms=5000)
    with pytest.raises(KafkaConnectionError):
        await asyncio.wait_for(admin.start(), timeout=30)
    await admin.close()
    assert "certificate is not valid for 'localhost'" in caplog.text
    errors: list[KafkaError] = []
    config = kafka_auth.admin_config(by_name)
    rdkafka = AdminClient(config | {"error_cb": errors.append, "reconnect.backoff.ms": 1000})
    with pytest.raises(KafkaException):
        await asyncio.to_thread(rdkafka.list_topics, timeout=5)
    await asyncio.to_thread(rdkafka.poll, 0)
    del rdkafka  # no more reconnecting
    assert any("certificate verify failed" in e.str() for e in errors), errors


def test_the_local_stack_refuses_to_start_a_broker_its_tls_clients_cannot_reach(
    tmp_path: Path,
) -> None:
    """Its broker takes no TLS: `sandstream up` with SASL_SSL settings and a local bootstrap
    says so at once, instead of starting one its clients fail to reach until the timeout."""
    settings = private_broker.private_settings(
        Settings(), tmp_path, kafka_security_protocol="SASL_SSL"
    )
    started = None
    try:
        with pytest.raises(stack.StackError, match=r"takes no TLS, but .* is SASL_SSL"):
            started = kafka_broker.start(settings)
    finally:
        if started is not None:  # the old code started one
            private_broker.stop(started)


def test_a_tls_broker_of_ones_own_already_listening_at_a_local_bootstrap_is_used(
    tmp_path: Path,
) -> None:
    """The refusal is for a broker the stack would start or runs itself: whatever already
    listens at the bootstrap (not started by the stack) is the operator's, and is used."""
    settings = private_broker.private_settings(
        Settings(), tmp_path, kafka_security_protocol="SASL_SSL"
    )
    host, port = settings.kafka_bootstrap.rsplit(":", 1)
    with socket.create_server((host, int(port))):
        assert kafka_broker.start(settings) is None
