"""Malformed input to the OpenShell door, through the real gRPC server (real Kafka, PostgreSQL
and Podman): each is INVALID_ARGUMENT naming the field, as the HTTP API's 422, never INTERNAL.
Each case below was INTERNAL (or, for a negative execution_timeout, the command ran and then
ended DEADLINE_EXCEEDED) before: a NUL reached PostgreSQL, a time out of Python's range reached
``datetime``, a huge Duration overflowed ``timedelta``."""

from __future__ import annotations

import base64
import secrets
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from openshell_support import EXEC_LIMIT, Gateway, auth, call, running_gateway, stream
from podman import PodmanClient
from pydantic import SecretStr

from services.openshell.proto.vendored.v0_0_116 import datamodel_pb2 as dm0
from services.openshell.proto.vendored.v0_0_116 import openshell_pb2 as os0
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1

SCOPE = dm1.WorkspaceSelector(workspace="default")
KEY = SecretStr(base64.b64encode(secrets.token_bytes(32)).decode())
STATIC = os1.PROVIDER_CREDENTIAL_REFRESH_STRATEGY_STATIC
NUL = "a\x00"
SANDBOX = "no-such-sandbox"  # a valid name: the check of the provider comes first


@pytest.fixture(scope="module", name="gateway")
async def gateway_fixture(podman: PodmanClient) -> AsyncIterator[Gateway]:
    # With a credentials key: without one, a rotation stops at the missing key (UNAVAILABLE).
    async with running_gateway(podman, "osbad", credentials_key=KEY) as gateway:
        yield gateway


PROVIDER_CASES = [
    ("GetProvider", os0.GetProviderRequest(name=NUL), "name"),
    ("GetProvider", os1.GetProviderRequest(name=NUL, workspace_scope=SCOPE), "name"),
    ("DeleteProvider", os0.DeleteProviderRequest(name=NUL), "name"),
    (
        "DeleteProvider",
        os1.DeleteProviderRequest(name=NUL, workspace_scope=SCOPE, allow_missing=True),
        "name",
    ),
    (
        "RotateProviderCredential",
        os0.RotateProviderCredentialRequest(provider=NUL, credential_key="K"),
        "provider",
    ),
    (
        "RotateProviderCredential",
        os1.RotateProviderCredentialRequest(provider=NUL, credential_key="K"),
        "provider",
    ),
    (
        "RotateProviderCredential",
        os1.RotateProviderCredentialRequest(provider="p", credential_key="K\x00"),
        "credential_key",
    ),
    (
        "ConfigureProviderRefresh",
        os0.ConfigureProviderRefreshRequest(provider=NUL, credential_key="K", strategy=STATIC),
        "provider",
    ),
    (
        "ConfigureProviderRefresh",
        os1.ConfigureProviderRefreshRequest(provider="p", credential_key="K\x00", strategy=STATIC),
        "credential_key",
    ),
    (
        "AttachSandboxProvider",
        os0.AttachSandboxProviderRequest(sandbox_name=SANDBOX, provider_name=NUL),
        "provider_name",
    ),
    (
        "AttachSandboxProvider",
        os1.AttachSandboxProviderRequest(sandbox=SANDBOX, provider=NUL, workspace_scope=SCOPE),
        "provider",
    ),
    (
        "DetachSandboxProvider",
        os0.DetachSandboxProviderRequest(sandbox_name=SANDBOX, provider_name=NUL),
        "provider_name",
    ),
    (
        "DetachSandboxProvider",
        os1.DetachSandboxProviderRequest(sandbox=SANDBOX, provider=NUL, workspace_scope=SCOPE),
        "provider",
    ),
]


def case_id(case: tuple[str, Message, str]) -> str:
    method, request, field = case
    return f"{method}-{request.DESCRIPTOR.file.package}-{field}"


async def invalid_argument(error: grpc.aio.AioRpcError, field: str) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert (error.details() or "").startswith(field + ":"), error.details()


@pytest.mark.parametrize("case", PROVIDER_CASES, ids=case_id)
async def test_a_nul_in_a_provider_name_or_key_is_invalid_argument_naming_the_field(
    gateway: Gateway, case: tuple[str, Message, str]
) -> None:
    method, request, field = case
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(gateway, method, request, Message)
    await invalid_argument(raised.value, field)


LOG_CASES = [
    (os0.GetSandboxLogsRequest(sandbox_id=SANDBOX, since_ms=2**62), "since_ms"),
    (os0.GetSandboxLogsRequest(sandbox_id=SANDBOX, since_ms=-(2**62)), "since_ms"),
    (
        os1.GetSandboxLogsRequest(sandbox=SANDBOX, since_time=Timestamp(seconds=10**15)),
        "since_time",
    ),
    (
        os1.GetSandboxLogsRequest(sandbox=SANDBOX, since_time=Timestamp(seconds=-(10**15))),
        "since_time",
    ),
    (os1.GetSandboxLogsRequest(sandbox=SANDBOX, since_time=Timestamp(nanos=-5)), "since_time"),
]


@pytest.mark.parametrize(
    "case",
    LOG_CASES,
    ids=[
        "since_ms-2e62",
        "since_ms-minus-2e62",
        "seconds-1e15",
        "seconds-minus-1e15",
        "nanos-minus-5",
    ],
)
async def test_a_logs_start_out_of_range_is_invalid_argument_naming_the_field(
    gateway: Gateway, case: tuple[Message, str]
) -> None:
    request, field = case
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(gateway, "GetSandboxLogs", request, Message)
    await invalid_argument(raised.value, field)


@pytest.mark.parametrize(
    ("timeout", "words"),
    [
        (Duration(seconds=10**15), f"at most {EXEC_LIMIT} seconds"),
        (Duration(seconds=-5), "must not be negative"),
        (Duration(nanos=-5), "must not be negative"),
        (Duration(seconds=1, nanos=-5), "nanos"),
    ],
    ids=["seconds-1e15", "seconds-minus-5", "nanos-minus-5", "mixed-signs"],
)
async def test_an_execution_timeout_out_of_range_is_invalid_argument(
    gateway: Gateway, timeout: Duration, words: str
) -> None:
    """Refused before the sandbox is looked up (none exists here), so nothing runs."""
    request = os1.ExecSandboxRequest(
        sandbox=SANDBOX, command=["true"], execution_timeout=timeout, workspace_scope=SCOPE
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async for _ in stream(gateway, "ExecSandbox", request, Message):
            pass
    await invalid_argument(raised.value, "execution_timeout")
    assert words in (raised.value.details() or "")


EXEC_CASES = [
    ({"command": ["echo", "a\x00b"]}, "command"),
    ({"command": ["true"], "environment": {"": "x"}}, "environment"),
    ({"command": ["true"], "environment": {"A=B": "x"}}, "environment"),
    ({"command": ["true"], "environment": {"C": "\x00"}}, "environment"),
    ({"command": ["true"], "workdir": "tmp"}, "workdir"),
    ({"command": ["true"], "workdir": "/\x00"}, "workdir"),
]


@pytest.mark.parametrize(
    "case", EXEC_CASES, ids=["argv-nul", "env-empty", "env-equals", "env-nul", "relative", "nul"]
)
async def test_an_exec_the_http_door_refuses_is_invalid_argument(
    gateway: Gateway, case: tuple[dict[str, object], str]
) -> None:
    """ExecSandbox skipped the HTTP door's checks of argv, environment and workdir (its 422):
    the same checks now, before the sandbox is looked up (none exists here: it was
    NOT_FOUND)."""
    fields, field = case
    for request in (
        os1.ExecSandboxRequest(sandbox=SANDBOX, workspace_scope=SCOPE, **fields),
        os0.ExecSandboxRequest(sandbox_id=SANDBOX, **fields),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            async for _ in stream(gateway, "ExecSandbox", request, Message):
                pass
        await invalid_argument(raised.value, field)


@pytest.mark.parametrize("provider", ["a\x00b", "p" * 129], ids=["nul", "long"])
async def test_a_provider_name_beside_a_template_is_invalid_argument(
    gateway: Gateway, provider: str
) -> None:
    """A create with ``workload_template`` took ``spec.providers`` unchecked: a NUL reached
    PostgreSQL (INTERNAL), a name too long was NOT_FOUND. Checked as a create without one
    checks them."""
    template = f"tpl-{secrets.token_hex(4)}"
    made = os1.SandboxWorkloadTemplate(metadata=dm1.ObjectMeta(name=template))
    await call(
        gateway,
        "CreateSandboxTemplate",
        os1.CreateSandboxTemplateRequest(template=made, workspace_scope=SCOPE),
        Message,
    )
    request = os1.CreateSandboxRequest(
        name="with-providers",
        workspace_scope=SCOPE,
        workload_template=template,
        spec=os1.SandboxSpec(providers=[provider]),
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(gateway, "CreateSandbox", request, Message)
    await invalid_argument(raised.value, "spec.providers")


async def test_a_negative_template_page_size_is_invalid_argument(gateway: Gateway) -> None:
    """It was INTERNAL (a negative slice, then the last of no items)."""
    request = os1.ListSandboxTemplatesRequest(page_size=-1, workspace_scope=SCOPE)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(gateway, "ListSandboxTemplates", request, Message)
    await invalid_argument(raised.value, "page_size")


@pytest.mark.parametrize("resource", ["cpu", "memory"])
async def test_a_huge_template_quantity_is_invalid_argument(
    gateway: Gateway, resource: str
) -> None:
    """A megabyte of digits overflowed Decimal's context: INTERNAL."""
    template = os1.SandboxWorkloadTemplate(metadata=dm1.ObjectMeta(name="huge-quantity"))
    setattr(template.spec.workload.resources, resource, "9" * 1_000_000)
    request = os1.CreateSandboxTemplateRequest(template=template, workspace_scope=SCOPE)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(gateway, "CreateSandboxTemplate", request, Message)
    await invalid_argument(raised.value, f"spec.workload.resources.{resource}")


LONG = "a" * 20_000
WIDE = "\u20ac" * 20_000  # three bytes each in UTF-8, nine once percent-encoded in a trailer


@pytest.mark.parametrize(
    ("method", "request_", "code", "start", "end"),
    [
        (
            "CreateSandbox",
            os1.CreateSandboxRequest(name=LONG, workspace_scope=SCOPE, spec=os1.SandboxSpec()),
            grpc.StatusCode.INVALID_ARGUMENT,
            "name '",
            "",
        ),
        (
            "CreateSandbox",
            os1.CreateSandboxRequest(
                name="long-label",
                workspace_scope=SCOPE,
                labels={LONG + "!": "v"},
                spec=os1.SandboxSpec(),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "labels",
            "",
        ),
        (
            "GetSandbox",
            os1.GetSandboxRequest(name=WIDE, workspace_scope=SCOPE),
            grpc.StatusCode.NOT_FOUND,
            "sandbox '",
            "not found",
        ),
        (
            "GetSandbox",
            os1.GetSandboxRequest(name="x", workspace_scope=dm1.WorkspaceSelector(workspace=WIDE)),
            grpc.StatusCode.NOT_FOUND,
            "workspace '",
            "not found",
        ),
    ],
    ids=["name", "label-key", "missing-name", "workspace"],
)
async def test_an_error_echoing_a_huge_value_still_names_the_field_and_fits_the_metadata(
    gateway: Gateway,
    method: str,
    request_: Message,
    code: grpc.StatusCode,
    start: str,
    end: str,
) -> None:
    """A 20,000-character value echoed whole made the message exceed the client's 16 KB
    metadata limit: the client saw RESOURCE_EXHAUSTED, not the status nor the field. Now the
    echo is cut in the middle: the status, the field and what is wrong arrive."""
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(gateway, method, request_, Message)
    details = raised.value.details() or ""
    assert raised.value.code() == code, (raised.value.code(), details[:300])
    assert details.startswith(start) and details.endswith(end), details
    assert "characters cut]" in details and len(details) < 1000


@pytest.mark.parametrize("generation", ["0.0", "0.1"])
async def test_a_nul_in_a_provider_value_is_invalid_argument(
    gateway: Gateway, generation: str
) -> None:
    """A value becomes an environment variable, which cannot hold a NUL: accepted before, the
    agent saw it cut. Refused by the same check as the HTTP API's 422."""
    name = f"nul-{secrets.token_hex(4)}"
    request: Message
    if generation == "0.0":
        old = dm0.Provider(metadata=dm0.ObjectMeta(name=name), credentials={"K": "v\x00"})
        request = os0.CreateProviderRequest(provider=old)
    else:
        new = dm1.Provider(
            metadata=dm1.ObjectMeta(name=name), type="generic", credentials={"K": "v\x00"}
        )
        request = os1.CreateProviderRequest(provider=new, workspace_scope=SCOPE)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(gateway, "CreateProvider", request, Message)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
    assert "NUL" in (raised.value.details() or ""), raised.value.details()


async def test_two_authorization_entries_are_unauthenticated(gateway: Gateway) -> None:
    """The door read the last of two entries where the HTTP API read the first: both refuse."""
    two = auth() + auth()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(gateway, "ListProviders", os1.ListProvidersRequest(), Message, metadata=two)
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED, raised.value
    assert "more than one Authorization header" in (raised.value.details() or "")


class Encoded(bytes):
    """Bytes sent as they are: a request no message class would build."""

    def SerializeToString(self) -> bytes:  # the protobuf method call() uses
        return bytes(self)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    return varint((number << 3) | 2) + varint(len(payload)) + payload


async def test_a_create_nesting_a_struct_thousands_deep_is_invalid_argument(
    gateway: Gateway,
) -> None:
    """``spec.template.resources`` is a google.protobuf.Struct, which nests: the check for
    0.1-only fields inside messages followed it 3,000 levels down and overflowed the C stack,
    and the gateway's process ended with a segmentation fault. The nesting read is bounded as
    protobuf's parser bounds it; the gateway answers INVALID_ARGUMENT and serves on."""
    struct = b""
    for _ in range(3000):  # Struct{fields: {"k": Value{struct_value: <struct>}}}
        value = length_delimited(5, struct)
        struct = length_delimited(1, length_delimited(1, b"k") + length_delimited(2, value))
    spec = length_delimited(6, length_delimited(7, struct))  # spec.template.resources
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call(gateway, "CreateSandbox", Encoded(length_delimited(1, spec)), Message)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
    assert "nests messages deeper than 100" in (raised.value.details() or "")
    request = os1.ListProvidersRequest(workspace_scope=SCOPE)
    assert isinstance(await call(gateway, "ListProviders", request, os1.ListProvidersResponse),
                      os1.ListProvidersResponse)  # fmt: skip
