"""The OpenShell <-> sandstream mapping (pure functions) and the generated proto modules."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from drivers.podman import PodmanDriver
from events.common import Phase, SandboxSpec
from services.api.readmodel import SandboxView, conditions
from services.common.settings import Settings
from services.common.tokens import (
    AUDIT,
    EXEC,
    OPS,
    PROVIDER_READ,
    PROVIDER_WRITE,
    READ,
    SCOPES,
    TWO_TOKENS,
    WRITE,
    Principal,
    TokenStore,
)
from services.openshell import mapping
from services.openshell.mapping import InvalidRequest, new_sandbox
from services.openshell.proto import generate, openshell_pb2_grpc
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as v0_1_5
from services.openshell.server import (
    OpenShellConfigError,
    check_settings,
    exec_driver,
    start_openshell,
)
from services.openshell.service import LOCAL_NAME, Authenticator

OS = pb.SandboxPhase
IMAGE = "localhost/base:1"


def view(phase: Phase, exit_code: int | None = None, **spec: object) -> SandboxView:
    at = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
    sandbox_spec = SandboxSpec.model_validate(
        {"image": IMAGE, "command": ["sleep", "1"], "labels": {"team": "a"}} | spec
    )
    return SandboxView(
        id=uuid.UUID(int=7),
        name="box",
        member_key="box",
        phase=phase,
        generation=2,
        version=9,
        spec=sandbox_spec,
        labels=dict(sandbox_spec.labels),
        providers=["p1"],
        identity="rid",
        conditions=conditions(phase, None),
        exit_code=exit_code,
        reason=None,
        created_at=at,
        updated_at=at,
        change_seq=1,
    )


def create(**request: object) -> pb.CreateSandboxRequest:
    return pb.CreateSandboxRequest(**request)  # type: ignore[arg-type]


# -- phases and resources ------------------------------------------------------------------------


def test_every_phase_has_an_openshell_phase() -> None:
    assert set(mapping.PHASES) == set(Phase)
    assert mapping.phase_of(Phase.COMPLETED) == OS.SANDBOX_PHASE_STOPPED
    assert mapping.phase_of(Phase.DELETED) == OS.SANDBOX_PHASE_DELETING
    same = {"PROVISIONING", "STARTING", "READY", "STOPPING", "STOPPED", "ERROR", "DELETING"}
    for name in same:
        assert mapping.phase_of(Phase[name]) == OS.Value(f"SANDBOX_PHASE_{name}")


def test_a_row_becomes_an_openshell_sandbox() -> None:
    message = mapping.sandbox_message(view(Phase.READY))
    assert message.metadata.id == str(uuid.UUID(int=7))
    assert message.metadata.name == "box"
    assert message.metadata.labels == {"team": "a"}
    assert message.metadata.resource_version == 9
    assert message.metadata.created_at_ms == 1767323045678
    assert message.metadata.deletion_timestamp_ms == 0
    assert message.spec.template.image == IMAGE
    assert list(message.spec.command) == ["sleep", "1"]
    assert list(message.spec.providers) == ["p1"]
    assert message.status.phase == OS.SANDBOX_PHASE_READY
    assert not message.status.HasField("exit_code")
    ready = {c.type: c.status for c in message.status.conditions}
    assert ready["Ready"] == "True"


def test_exit_codes_are_shown_for_error_and_completed_only() -> None:
    failed = mapping.sandbox_message(view(Phase.ERROR, exit_code=3))
    assert failed.status.phase == OS.SANDBOX_PHASE_ERROR and failed.status.exit_code == 3
    done = mapping.sandbox_message(view(Phase.COMPLETED, exit_code=0))
    assert done.status.phase == OS.SANDBOX_PHASE_STOPPED and done.status.HasField("exit_code")
    stopped = mapping.sandbox_message(view(Phase.STOPPED, exit_code=143))
    assert not stopped.status.HasField("exit_code")


def test_the_restart_count_and_next_restart_time_reach_0_1_readers() -> None:
    due = datetime(2026, 1, 2, 3, 5, tzinfo=UTC)
    row = view(Phase.ERROR, exit_code=1).model_copy(
        update={"restart_count": 2, "next_restart_at": due}
    )
    wire = mapping.sandbox_message(row).status.SerializeToString()
    status = v0_1_5.SandboxStatus.FromString(wire)
    assert status.restart_count == 2
    assert status.next_restart_time.ToDatetime(tzinfo=UTC) == due
    idle = v0_1_5.SandboxStatus.FromString(
        mapping.sandbox_message(view(Phase.READY)).status.SerializeToString()
    )
    assert (idle.restart_count, idle.HasField("next_restart_time")) == (0, False)


@pytest.mark.parametrize(
    ("requested", "policy"),
    [
        (v0_1_5.SANDBOX_RESTART_POLICY_UNSPECIFIED, None),
        (v0_1_5.SANDBOX_RESTART_POLICY_NEVER, None),
        (v0_1_5.SANDBOX_RESTART_POLICY_ON_FAILURE, "OnFailure"),
        (v0_1_5.SANDBOX_RESTART_POLICY_ALWAYS, "Always"),
    ],
)
def test_a_0_1_restart_policy_maps_onto_the_spec_and_back(requested: int, policy: str) -> None:
    request = v0_1_5.CreateSandboxRequest(
        name="a",
        spec=v0_1_5.SandboxSpec(restart_policy=requested),  # type: ignore[arg-type]
    )
    wanted = new_sandbox(request, default_image=IMAGE, command_id=None)
    assert wanted.spec.restart_policy == policy
    answer = mapping.sandbox_message(view(Phase.READY, restart_policy=policy)).spec
    read = v0_1_5.SandboxSpec.FromString(answer.SerializeToString())
    never = v0_1_5.SANDBOX_RESTART_POLICY_NEVER
    assert read.restart_policy == (requested if policy else never)
    old = pb.SandboxSpec.FromString(answer.SerializeToString())  # a 0.0 reader skips it
    assert old.template.image == IMAGE


def test_an_unknown_0_1_restart_policy_is_invalid() -> None:
    request = v0_1_5.CreateSandboxRequest(
        name="a",
        spec=v0_1_5.SandboxSpec(restart_policy=7),  # type: ignore[arg-type]
    )
    with pytest.raises(InvalidRequest, match=r"spec\.restart_policy"):
        new_sandbox(request, default_image=IMAGE, command_id=None)


def test_deleting_rows_carry_a_deletion_timestamp() -> None:
    message = mapping.sandbox_message(view(Phase.DELETING))
    assert message.metadata.deletion_timestamp_ms == message.metadata.created_at_ms


# -- create requests -----------------------------------------------------------------------------


def test_an_empty_spec_gets_the_base_image_and_a_long_running_process() -> None:
    wanted = new_sandbox(create(name="a", spec=pb.SandboxSpec()), default_image=IMAGE,
                         command_id=None)  # fmt: skip
    assert wanted.name == "a"
    assert wanted.spec.image == IMAGE
    assert wanted.spec.command == list(mapping.DEFAULT_COMMAND)


def test_spec_fields_map_onto_the_sandstream_spec() -> None:
    spec = pb.SandboxSpec(
        environment={"A": "1", "B": "spec"},
        template=pb.SandboxTemplate(image="img:2", labels={"t": "x"}, environment={"B": "tpl"}),
        command=["sh", "-c", "true"],
        providers=["github"],
    )
    wanted = new_sandbox(
        create(name="a", spec=spec, labels={"team": "b"}), default_image=IMAGE, command_id=None
    )
    assert wanted.spec.image == "img:2"
    assert wanted.spec.command == ["sh", "-c", "true"]
    assert wanted.spec.env == {"A": "1", "B": "spec"}  # the spec's environment wins
    assert wanted.spec.labels == {"t": "x", "team": "b"}
    assert wanted.providers == ["github"]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (create(), "spec"),
        (
            create(
                spec=pb.SandboxSpec(
                    resource_requirements=pb.ResourceRequirements(
                        gpu=pb.GpuResourceRequirements(count=0)
                    )
                )
            ),
            "spec.resource_requirements.gpu.count",
        ),
        (
            create(
                spec=pb.SandboxSpec(
                    resource_requirements=pb.ResourceRequirements(gpu=pb.GpuResourceRequirements())
                )
            ),
            "spec.resource_requirements.gpu",
        ),
        (create(name="Bad_Name", spec=pb.SandboxSpec()), "name"),
        (create(spec=pb.SandboxSpec(), labels={"-bad": "1"}), "labels"),
        (create(spec=pb.SandboxSpec(environment={"1X": "1"})), "spec.environment"),
        (create(spec=pb.SandboxSpec(), annotations={"a": "1"}), "annotations"),
        (
            create(spec=pb.SandboxSpec(template=pb.SandboxTemplate(runtime_class_name="gvisor"))),
            "spec.template.runtime_class_name",
        ),
        (create(spec=pb.SandboxSpec(providers=["a b"])), "spec.providers"),
    ],
)
def test_invalid_requests_name_the_field(request_: pb.CreateSandboxRequest, field: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        new_sandbox(request_, default_image=IMAGE, command_id=None)
    assert str(raised.value).startswith(field), str(raised.value)


def test_generated_names_follow_the_command_id() -> None:
    request = create(spec=pb.SandboxSpec())
    first = new_sandbox(request, default_image=IMAGE, command_id="c-1").name
    assert first == new_sandbox(request, default_image=IMAGE, command_id="c-1").name
    assert first != new_sandbox(request, default_image=IMAGE, command_id="c-2").name
    assert first.startswith(mapping.GENERATED_PREFIX)
    without = {new_sandbox(request, default_image=IMAGE, command_id=None).name for _ in range(3)}
    assert len(without) == 3


# -- lists ---------------------------------------------------------------------------------------


def test_label_selectors_become_equality_filters() -> None:
    assert mapping.label_filters("") == []
    assert mapping.label_filters("a=1, b=2") == ["a=1", "b=2"]
    assert mapping.label_filters("a=") == ["a="]
    for bad in ("a", "a!=1", "=1", "a=1=2"):
        with pytest.raises(InvalidRequest, match="label_selector"):
            mapping.label_filters(bad)


def test_the_generated_modules_are_fresh(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    produced = tmp_path / generate.PROTO_DIR.relative_to(generate.ROOT)
    stale = [
        name
        for name in generate.generated_names()
        if (produced / name).read_bytes() != (generate.PROTO_DIR / name).read_bytes()
    ]
    assert not stale, f"regenerate with `python -m services.openshell.proto.generate`: {stale}"


def test_the_wire_names_are_openshells() -> None:
    service = pb.DESCRIPTOR.services_by_name["OpenShell"]
    assert service.full_name == "openshell.v1.OpenShell"
    assert pb.Sandbox.DESCRIPTOR.fields_by_name["status"].number == 3
    assert pb.SandboxSpec.DESCRIPTOR.fields_by_name["command"].number == 12
    config = service.methods_by_name["GetSandboxConfig"]
    assert config.input_type.full_name == "openshell.sandbox.v1.GetSandboxConfigRequest"


# -- auth and settings ---------------------------------------------------------------------------


def test_unauthenticated_calls_only_when_allowed_and_credentials_are_always_checked() -> None:
    tokens = TokenStore.of(admin=("sst_a", READ, WRITE), reader=("sst_r", READ))
    strict, local = Authenticator(tokens), Authenticator(tokens, allow_unauthenticated=True)
    assert strict.check([], READ)[0] == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[index]
    assert local.check([], WRITE) == Principal(LOCAL_NAME, frozenset({READ, WRITE}))
    assert local.check(["Bearer sst_x"], READ)[0] == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[index]
    assert local.check(["Bearer sst_r"], WRITE)[0] == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[index]
    admin = strict.check(["Bearer sst_a"], WRITE)
    assert isinstance(admin, Principal) and admin.name == "admin"
    # Two entries are refused, whichever they are: the HTTP door read the first, this the last.
    for two in (["Bearer sst_r", "Bearer sst_a"], ["Bearer sst_a", "Bearer sst_a"]):
        assert strict.check(two, READ) == (grpc.StatusCode.UNAUTHENTICATED, TWO_TOKENS)


def test_unauthenticated_calls_hold_only_sandbox_reads_and_commands_unless_configured(
    settings: Settings,
) -> None:
    tokens = TokenStore.of(admin=("sst_a", *SCOPES))
    local = Authenticator(tokens, allow_unauthenticated=True)
    for scope in (EXEC, PROVIDER_WRITE, PROVIDER_READ, AUDIT, OPS):
        refused = local.check([], scope)
        assert isinstance(refused, tuple), scope
        assert refused[0] == grpc.StatusCode.PERMISSION_DENIED
        assert scope in refused[1] and "SANDSTREAM_OPENSHELL_UNAUTHENTICATED_SCOPES" in refused[1]
    admin = local.check(["Bearer sst_a"], EXEC)  # a token still gets what it holds
    assert isinstance(admin, Principal) and admin.name == "admin"
    # The server builds its door from the settings: the default, then more scopes configured.
    assert settings.openshell_local_scopes == {READ, WRITE}
    configured = Settings(
        **{**settings.model_dump(), "openshell_unauthenticated_scopes": f"{READ}, {EXEC}"}
    )
    assert configured.openshell_local_scopes == {READ, EXEC}
    wider = Authenticator(tokens, True, configured.openshell_local_scopes)
    assert wider.check([], EXEC) == Principal(LOCAL_NAME, frozenset({READ, EXEC}))
    assert isinstance(wider.check([], WRITE), tuple)


def test_unknown_unauthenticated_scopes_are_refused_at_start(settings: Settings) -> None:
    wrong = {"openshell_unauthenticated_scopes": "sandbox:read,sandbox:everything"}
    with pytest.raises(OpenShellConfigError, match="unknown scopes sandbox:everything"):
        check_settings(settings.model_copy(update=wrong))


def test_unauthenticated_calls_are_refused_off_loopback(settings: Settings) -> None:
    check_settings(settings.model_copy(update={"openshell_allow_unauthenticated": True}))
    check_settings(settings.model_copy(update={"openshell_host": "0.0.0.0"}))
    exposed = {"openshell_allow_unauthenticated": True, "openshell_host": "0.0.0.0"}
    with pytest.raises(OpenShellConfigError, match="loopback"):
        check_settings(settings.model_copy(update=exposed))


async def test_a_second_server_on_a_taken_port_fails_to_start(settings: Settings) -> None:
    idle = SimpleNamespace(feed=None)  # no call reaches the services: only binding is tested
    first = await start_openshell(
        settings.model_copy(update={"openshell_port": 0}),
        pool=None,  # type: ignore[arg-type]
        gateway=idle,  # type: ignore[arg-type]
        tokens=TokenStore([]),
        driver=None,
    )
    try:
        port = int(first.address.rsplit(":", 1)[1])
        with pytest.raises(OSError, match="SANDSTREAM_OPENSHELL_PORT"):
            await start_openshell(
                settings.model_copy(update={"openshell_port": port}),
                pool=None,  # type: ignore[arg-type]
                gateway=idle,  # type: ignore[arg-type]
                tokens=TokenStore([]),
                driver=None,
            )
    finally:
        await first.stop(0)


async def test_gateway_info_names_the_configured_driver(settings: Settings) -> None:
    """GetGatewayInfo reports the driver the sandboxes run on (it said "podman" whatever it
    was)."""
    idle = SimpleNamespace(feed=None)  # GetGatewayInfo reads no row
    served = await start_openshell(
        settings.model_copy(update={"openshell_port": 0, "driver": "kubernetes"}),
        pool=None,  # type: ignore[arg-type]
        gateway=idle,  # type: ignore[arg-type]
        tokens=TokenStore.of(reader=("sst_reader", READ)),
        driver=None,
    )
    try:
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = openshell_pb2_grpc.OpenShellStub(channel)
            info = await stub.GetGatewayInfo(
                pb.GetGatewayInfoRequest(), metadata=[("authorization", "Bearer sst_reader")]
            )
        assert [d.name for d in info.compute_drivers] == ["kubernetes"]
    finally:
        await served.stop(0)


def test_the_openshell_role_alone_execs_through_the_backend_its_sandboxes_run_on(
    settings: Settings,
) -> None:
    """Run alone under the Kubernetes driver, the role execs through the Pods' exec
    subresource, never a Podman driver aimed at a socket the deployment lacks; under the fake
    driver it has none (ExecSandbox answers UNIMPLEMENTED)."""
    from drivers.kube_exec import KubeExec

    assert isinstance(exec_driver(settings.model_copy(update={"driver": "kubernetes"})), KubeExec)
    assert isinstance(exec_driver(settings.model_copy(update={"driver": "podman"})), PodmanDriver)
    assert exec_driver(settings.model_copy(update={"driver": "fake"})) is None
