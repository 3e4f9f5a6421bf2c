"""Providers over OpenShell's gRPC, in both protocol generations' messages, on real Kafka,
PostgreSQL and Podman: the provider RPCs, a sandbox's providers, scopes, a stale
expected_resource_version, refresh strategies, write-only values, and an update and a
rotation over gRPC restarting an attached Ready sandbox on the new value. One gateway (with a
credentials key) for the module; one sandbox."""

from __future__ import annotations

import base64
import secrets
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from harness import eventually
from openshell_support import (
    READER,
    WAIT,
    WRITER,
    Gateway,
    Phase,
    auth,
    call,
    create,
    running_gateway,
    status_of,
    wait_phase,
)
from podman import PodmanClient
from pydantic import SecretStr

from drivers.podman_secrets import SECRETS_DIR
from services.api import readmodel
from services.common import templates
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto.vendored.v0_0_116 import datamodel_pb2 as dm0
from services.openshell.proto.vendored.v0_0_116 import openshell_pb2 as os0
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1

SCOPE = dm1.WorkspaceSelector(workspace="default")
KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())
Strategy = os1.ProviderCredentialRefreshStrategy


@pytest.fixture(scope="module", name="gateway")
async def gateway_fixture(podman: PodmanClient) -> AsyncIterator[Gateway]:
    async with running_gateway(podman, "osprov", credentials_key=KEY) as gateway:
        yield gateway


def provider_name() -> str:
    return "osprov-" + uuid.uuid4().hex[:10]


def secret() -> str:
    return "value-" + secrets.token_hex(8)


class Answers:
    """Every answer a test gets, to check that no value ever comes back."""

    def __init__(self) -> None:
        self.raw: list[bytes] = []

    async def __call__(self, gw: Gateway, method: str, request: Message, answer: type[Message],
                       **kw: Any) -> Any:  # fmt: skip
        got = await call(gw, method, request, answer, **kw)
        self.raw.append(got.SerializeToString())
        return got

    def never_carried(self, *values: str) -> None:
        assert self.raw
        for value in values:
            assert not any(value.encode() in raw for raw in self.raw), value


async def refused(gw: Gateway, method: str, request: Message, **kw: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(gw, method, request, Message, **kw)
    return raised.value


async def list_all_new(gw: Gateway) -> tuple[list[str], int]:
    """Every provider a page of one at a time (0.1's page tokens): names, pages."""
    names: list[str] = []
    token, pages = "", 0
    while True:
        request = os1.ListProvidersRequest(workspace_scope=SCOPE, page_size=1, page_token=token)
        page = await call(gw, "ListProviders", request, os1.ListProvidersResponse)
        names += [p.metadata.name for p in page.providers]
        pages += 1
        token = page.next_page_token
        if not token:
            return names, pages


async def test_provider_rpcs_in_both_generations_never_return_values(gateway: Gateway) -> None:
    ask = Answers()
    a, b = sorted((provider_name(), provider_name()))
    first, second = secret(), secret()
    provider = dm1.Provider(
        metadata=dm1.ObjectMeta(name=a), type="github", credentials={"GH_TOKEN": first}
    )
    made = await ask(
        gateway,
        "CreateProvider",
        os1.CreateProviderRequest(provider=provider, workspace_scope=SCOPE, request_id="mk-" + a),
        os1.ProviderResponse,
    )
    assert made.provider.metadata.name == a and made.provider.type == "github"
    assert dict(made.provider.credentials) == {"GH_TOKEN": ""}
    assert made.mutation_id == "mk-" + a
    assert str(uuid.UUID(made.provider.metadata.id)) == made.provider.metadata.id
    old_provider = dm0.Provider(metadata=dm0.ObjectMeta(name=b), credentials={"K": second})
    await ask(
        gateway, "CreateProvider", os0.CreateProviderRequest(provider=old_provider),
        os0.ProviderResponse,
    )  # fmt: skip
    again = await refused(
        gateway, "CreateProvider", os0.CreateProviderRequest(provider=old_provider)
    )
    assert again.code() == grpc.StatusCode.ALREADY_EXISTS

    got = await ask(gateway, "GetProvider", os0.GetProviderRequest(name=a), os0.ProviderResponse)
    assert got.provider.metadata.id == made.provider.metadata.id
    assert got.provider.metadata.resource_version == 1
    names, pages = await list_all_new(gateway)
    assert [n for n in names if n in (a, b)] == [a, b] and pages >= 2
    old_page = await ask(
        gateway, "ListProviders", os0.ListProvidersRequest(limit=1, offset=names.index(b)),
        os0.ListProvidersResponse,
    )  # fmt: skip
    assert [p.metadata.name for p in old_page.providers] == [b]

    rotated = await ask(
        gateway,
        "UpdateProvider",
        os1.UpdateProviderRequest(
            provider=dm1.Provider(
                metadata=dm1.ObjectMeta(name=a), credentials={"GH_TOKEN": second}
            ),
            workspace_scope=SCOPE,
        ),
        os1.ProviderResponse,
    )
    assert rotated.provider.metadata.resource_version == 2
    assert list(rotated.target_receipts) == []  # attached to no sandbox
    assert rotated.mutation_id

    deleted = await ask(
        gateway, "DeleteProvider", os0.DeleteProviderRequest(name=a), os0.DeleteProviderResponse
    )
    assert deleted.deleted
    absent = await ask(
        gateway,
        "DeleteProvider",
        os1.DeleteProviderRequest(name=a, workspace_scope=SCOPE, allow_missing=True),
        os1.DeleteProviderResponse,
    )
    assert absent.outcome == os1.DELETION_OUTCOME_ALREADY_ABSENT
    missing = await refused(gateway, "GetProvider", os1.GetProviderRequest(name=a))
    assert missing.code() == grpc.StatusCode.NOT_FOUND
    ask.never_carried(first, second)


async def test_unkept_fields_reserved_keys_and_a_new_type_are_invalid_argument(
    gateway: Gateway,
) -> None:
    name = provider_name()
    with_config = dm1.Provider(metadata=dm1.ObjectMeta(name=name), config={"url": "x"})
    error = await refused(
        gateway, "CreateProvider", os1.CreateProviderRequest(provider=with_config)
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "provider.config" in (error.details() or "")
    reserved = dm1.Provider(
        metadata=dm1.ObjectMeta(name=name), credentials={"SANDSTREAM_IDENTITY": "x"}
    )
    error = await refused(gateway, "CreateProvider", os1.CreateProviderRequest(provider=reserved))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "SANDSTREAM_IDENTITY" in (error.details() or "")
    assert await status_of(
        call(gateway, "GetProvider", os1.GetProviderRequest(name=name), os1.ProviderResponse)
    ) == grpc.StatusCode.NOT_FOUND  # fmt: skip
    made = dm1.Provider(metadata=dm1.ObjectMeta(name=name), type="github")
    await call(gateway, "CreateProvider", os1.CreateProviderRequest(provider=made),
               os1.ProviderResponse)  # fmt: skip
    retyped = dm1.Provider(metadata=dm1.ObjectMeta(name=name), type="gitlab")
    error = await refused(gateway, "UpdateProvider", os1.UpdateProviderRequest(provider=retyped))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "provider.type" in (error.details() or "")


async def test_scopes_are_those_of_the_http_providers(gateway: Gateway) -> None:
    name = provider_name()
    create_it = os1.CreateProviderRequest(provider=dm1.Provider(metadata=dm1.ObjectMeta(name=name)))
    for token in (READER, WRITER):  # neither has provider:write
        error = await refused(gateway, "CreateProvider", create_it, metadata=auth(token))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    error = await refused(
        gateway, "ListProviders", os1.ListProvidersRequest(), metadata=auth(READER)
    )
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    await call(gateway, "CreateProvider", create_it, os1.ProviderResponse)
    sandbox = gateway.new_name()  # scopes are checked before the sandbox is looked up
    attach = os1.AttachSandboxProviderRequest(sandbox=sandbox, provider=name)
    error = await refused(gateway, "AttachSandboxProvider", attach, metadata=auth(WRITER))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED  # sandbox:write is not enough
    assert "provider:write" in (error.details() or "")
    listing = os1.ListSandboxProvidersRequest(sandbox=sandbox)
    error = await refused(gateway, "ListSandboxProviders", listing, metadata=auth(WRITER))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_strategies_that_mint_credentials_are_failed_precondition(gateway: Gateway) -> None:
    name = provider_name()
    provider = dm1.Provider(metadata=dm1.ObjectMeta(name=name), credentials={"K": secret()})
    await call(gateway, "CreateProvider", os1.CreateProviderRequest(provider=provider),
               os1.ProviderResponse)  # fmt: skip
    for strategy in ("OAUTH2_REFRESH_TOKEN", "OAUTH2_CLIENT_CREDENTIALS", "AWS_STS_ASSUME_ROLE"):
        request = os1.ConfigureProviderRefreshRequest(
            provider=name,
            credential_key="K",
            strategy=Strategy.Value("PROVIDER_CREDENTIAL_REFRESH_STRATEGY_" + strategy),
        )
        error = await refused(gateway, "ConfigureProviderRefresh", request)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert strategy in (error.details() or "")
    static = os0.ConfigureProviderRefreshRequest(
        provider=name, credential_key="K", strategy=os0.PROVIDER_CREDENTIAL_REFRESH_STRATEGY_STATIC
    )
    answer = await call(
        gateway, "ConfigureProviderRefresh", static, os0.ConfigureProviderRefreshResponse
    )
    assert answer.status.strategy == os0.PROVIDER_CREDENTIAL_REFRESH_STRATEGY_STATIC


async def value_in(gw: Gateway, sandbox_id: str, key: str) -> str:
    """The provider value the sandbox's generation was launched with (its mounted secret,
    which the main process gets as ``key``; an exec reads the file)."""
    read = f"cat {SECRETS_DIR}/{key} 2>/dev/null || true"
    request = pb.ExecSandboxRequest(sandbox_id=sandbox_id, command=["sh", "-c", read])
    events = [e async for e in gw.stub.ExecSandbox(request, metadata=auth(), timeout=WAIT)]
    return b"".join(e.stdout.data for e in events if e.HasField("stdout")).decode().strip()


async def restarted(gw: Gateway, name: str, generation: int) -> None:
    await eventually(
        lambda: readmodel.get_sandbox(gw.env.pool, name),
        lambda v: v is not None and (v.phase.value, v.generation) == ("Ready", generation),
        timeout=WAIT,
        what=f"{name} Ready at generation {generation}",
    )


async def test_attach_rotate_detach_over_grpc_restart_the_ready_sandbox(gateway: Gateway) -> None:
    ask = Answers()
    provider, first, second = provider_name(), secret(), secret()
    await ask(
        gateway,
        "CreateProvider",
        os1.CreateProviderRequest(
            provider=dm1.Provider(metadata=dm1.ObjectMeta(name=provider), credentials={"K": first})
        ),
        os1.ProviderResponse,
    )
    name = gateway.new_name()
    sandbox_id = (await create(gateway, name)).metadata.id
    ready = await wait_phase(gateway, sandbox_id, Phase.SANDBOX_PHASE_READY)
    version = ready.metadata.resource_version

    stale = os1.AttachSandboxProviderRequest(
        sandbox=name, provider=provider, expected_resource_version=version + 7
    )
    assert (
        await refused(gateway, "AttachSandboxProvider", stale)
    ).code() == grpc.StatusCode.ABORTED
    attached = await ask(
        gateway,
        "AttachSandboxProvider",
        os0.AttachSandboxProviderRequest(
            sandbox_name=name, provider_name=provider, expected_resource_version=version
        ),
        os1.AttachSandboxProviderResponse,
    )
    assert attached.attached and list(attached.sandbox.spec.providers) == [provider]
    assert attached.receipt.kind == os1.PROVIDER_MUTATION_KIND_ATTACH
    for request, answer in (
        (os0.ListSandboxProvidersRequest(sandbox_name=name), os0.ListSandboxProvidersResponse),
        (os1.ListSandboxProvidersRequest(sandbox=name, workspace_scope=SCOPE),
         os1.ListSandboxProvidersResponse),
    ):  # fmt: skip
        listed = await ask(gateway, "ListSandboxProviders", request, answer)
        assert [(p.metadata.name, dict(p.credentials)) for p in listed.providers] == [
            (provider, {"K": ""})
        ]

    # An attach applies at the next start; an update restarts the sandbox on the new value.
    updated = await ask(
        gateway,
        "UpdateProvider",
        os1.UpdateProviderRequest(
            provider=dm1.Provider(metadata=dm1.ObjectMeta(name=provider), credentials={"K": second})
        ),
        os1.ProviderResponse,
    )
    [receipt] = updated.target_receipts
    assert receipt.desired.sandbox == name and receipt.provider == provider
    assert receipt.kind == os1.PROVIDER_MUTATION_KIND_UPDATE and receipt.receipt_id
    await restarted(gateway, name, 2)
    assert await value_in(gateway, sandbox_id, "K") == second

    rotate = os0.RotateProviderCredentialRequest(provider=provider, credential_key="K")
    status = await ask(
        gateway, "RotateProviderCredential", rotate, os0.RotateProviderCredentialResponse
    )
    assert status.status.strategy == os0.PROVIDER_CREDENTIAL_REFRESH_STRATEGY_STATIC
    await restarted(gateway, name, 3)
    assert await value_in(gateway, sandbox_id, "K") == second
    in_use = await refused(gateway, "DeleteProvider", os1.DeleteProviderRequest(name=provider))
    assert in_use.code() == grpc.StatusCode.FAILED_PRECONDITION
    # The door has no force flag: the message says to detach first (it offered force=true).
    assert (in_use.details() or "").endswith(f"is attached to {name}: detach it first (or, over "
                                             "HTTP, delete with force=true, which detaches it; "
                                             "the CLI's --force)")  # fmt: skip

    detached = await ask(
        gateway,
        "DetachSandboxProvider",
        os1.DetachSandboxProviderRequest(sandbox=name, provider=provider, workspace_scope=SCOPE),
        os1.DetachSandboxProviderResponse,
    )
    assert detached.detached and detached.receipt.kind == os1.PROVIDER_MUTATION_KIND_DETACH
    await restarted(gateway, name, 4)
    assert await value_in(gateway, sandbox_id, "K") == ""
    await ask(gateway, "DeleteProvider", os1.DeleteProviderRequest(name=provider),
              os1.DeleteProviderResponse)  # fmt: skip
    ask.never_carried(first, second)
    await gateway.stub.DeleteSandbox(pb.DeleteSandboxRequest(name=name), metadata=auth())


async def test_provider_writes_retried_with_their_request_id_answer_the_first_outcome(
    gateway: Gateway,
) -> None:
    """A retried create, rotation and delete (0.1's request_id, 0.0's command-id metadata)
    change nothing a second time; the id reused for another request is ALREADY_EXISTS."""
    name, value = provider_name(), secret()
    made = dm1.Provider(metadata=dm1.ObjectMeta(name=name), credentials={"K": value})
    create_req = os1.CreateProviderRequest(provider=made, request_id="mk-" + name)
    created = [await call(gateway, "CreateProvider", create_req, os1.ProviderResponse)
               for _ in range(2)]  # fmt: skip
    assert created[1].provider.metadata.id == created[0].provider.metadata.id
    assert created[1].mutation_id == "mk-" + name

    rotate = os0.RotateProviderCredentialRequest(provider=name, credential_key="K")
    by_id = auth(command_id="rot-" + name)
    for _ in range(2):
        await call(gateway, "RotateProviderCredential", rotate,
                   os0.RotateProviderCredentialResponse, metadata=by_id)  # fmt: skip
    got = await call(gateway, "GetProvider", os0.GetProviderRequest(name=name),
                     os0.ProviderResponse)  # fmt: skip
    assert got.provider.metadata.resource_version == 2  # one rotation, not two

    update = os1.UpdateProviderRequest(provider=made, request_id="rot-" + name)
    reused = await refused(gateway, "UpdateProvider", update)
    assert reused.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "command_id 'rot-" in (reused.details() or "")

    delete = os1.DeleteProviderRequest(name=name, request_id="rm-" + name)
    deleted = [await call(gateway, "DeleteProvider", delete, os1.DeleteProviderResponse)
               for _ in range(2)]  # fmt: skip
    assert [d.outcome for d in deleted] == [os1.DELETION_OUTCOME_COMPLETED] * 2


async def test_a_0_1_only_field_inside_the_provider_makes_a_create_0_1(gateway: Gateway) -> None:
    """credential_expiration_times (0.1 only, not kept) with no top-level 0.1 field: it was
    read as 0.0 and accepted; it is refused by name as with a request_id."""
    name = provider_name()
    provider = dm1.Provider(metadata=dm1.ObjectMeta(name=name), credentials={"K": secret()})
    provider.credential_expiration_times["K"].seconds = 2_000_000_000
    error = await refused(gateway, "CreateProvider", os1.CreateProviderRequest(provider=provider))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "credential_expiration_times" in (error.details() or "")
    assert await status_of(
        call(gateway, "GetProvider", os1.GetProviderRequest(name=name), os1.ProviderResponse)
    ) == grpc.StatusCode.NOT_FOUND  # fmt: skip


async def test_delete_provider_is_failed_precondition_while_a_template_names_it(
    gateway: Gateway,
) -> None:
    name, template = provider_name(), "osprov-tpl-" + uuid.uuid4().hex[:8]
    provider = dm1.Provider(metadata=dm1.ObjectMeta(name=name), credentials={"K": secret()})
    await call(gateway, "CreateProvider", os1.CreateProviderRequest(provider=provider),
               os1.ProviderResponse)  # fmt: skip
    body = templates.TemplateBody.model_validate(
        {"spec": {"image": "registry.example/agent:1"}, "providers": [name]}
    )
    async with gateway.env.pool.acquire() as conn:
        await templates.create_template(conn, template, body, "test", datetime.now(UTC))
    named = await refused(gateway, "DeleteProvider", os1.DeleteProviderRequest(name=name))
    assert named.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"is named by template {template!r}" in (named.details() or "")
    async with gateway.env.pool.acquire() as conn:
        await templates.delete_template(conn, template)
    gone = await call(gateway, "DeleteProvider", os1.DeleteProviderRequest(name=name),
                      os1.DeleteProviderResponse)  # fmt: skip
    assert gone.outcome == os1.DELETION_OUTCOME_COMPLETED
