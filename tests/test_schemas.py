"""Wire schemas: round trips, strict validation with errors naming the field, exported files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args
from uuid import uuid4

import factories as f
import pytest
from pydantic import BaseModel, TypeAdapter

from events import schema_export
from events.codec import COMMANDS, EVENTS, OBSERVATIONS, DecodeError, check_key, decode, encode
from events.commands import Command
from events.common import Phase
from events.deadletter import dead_letter
from events.decided import DecidedEvent
from events.observations import Observation
from events.outcomes import CommandOutcome


def members(union: Any) -> set[type[BaseModel]]:
    """The model classes of an ``Annotated[A | B | ..., Field(discriminator=...)]``."""
    return set(get_args(get_args(union)[0]))


def all_commands() -> list[Command]:
    full = f.spec("img:1", command=["sh", "-c", "run"], env={"A_B": "1"}, labels={"a.b/c": "x"})
    return [
        f.create(sandbox_spec=full, providers=["gh", "aws"], occurred_at=f.at(1.5)),
        f.start(expected_version=3),
        f.stop(),
        f.restart(expected_version=0),
        f.suspend(),
        f.resume(expected_version=5),
        f.delete(),
        f.attach(provider="gh"),
        f.detach(provider="gh", expected_version=9),
        f.rotate(rotations={"gh": 2, "aws": 5}, restart=False),
        f.hold(reason="incident 42"),
        f.release(expected_version=2),
        f.extend(ttl_seconds=3600),
        f.set_restart_policy(restart_policy="Always", max_restarts=3, expected_version=4),
        f.create("pool-a1b2c3d4", pool="pool"),
        *claim_commands(),
    ]


def claim_commands() -> list[Command]:
    """A claim's four commands, as the rules send them (adopt, bind, abandon, unbind)."""
    h = f.Harness()
    h.send(f.create("p-1", pool="p"), f.running("p-1"), f.create("p-2", pool="p"))
    h.send(f.running("p-2"), f.create("taken"))
    h.send(f.adopt("p-1", "mine", "c1", labels={"team": "a"}), f.adopt("p-2", "taken", "c2"))
    h.send(*h.sent())  # bind "mine"; bind "taken" refused: abandon p-2
    h.send(*h.sent()[2:], f.delete("p-1"), f.deleted("p-1"))
    return [f.adopt("p-1", "mine", "c1", labels={"team": "a"}), *h.sent()]


def all_observations() -> list[Observation]:
    return [
        f.snapshot(state="exited", exit_code=137, runtime_id="c0ffee", source="list"),
        f.removed(runtime_id="c0ffee", source="reconcile"),
        f.result(
            operation="delete",
            outcome="failed",
            retryable=True,
            reason="timeout",
            identity="rid-1",
            observed="running",
            exit_code=1,
        ),
        f.due(deadline="ttl", due_at=f.at(60), occurred_at=f.at(61)),
    ]


def all_events() -> list[DecidedEvent]:
    """Decided events of every type, produced by the core itself."""
    h = f.Harness()
    h.send(f.create(providers=["gh"]), f.attach(provider="aws"), f.detach(provider="gh"))
    # (The launch's report says it did not read the detached provider: Ready, no restart.)
    h.send(f.launched(credentials={"aws": 1}), f.stop())
    h.send(f.failed(operation="stop", observed="running"))  # still Stopping: a retry
    h.send(f.due(deadline="stop", due_at=h.row().deadline.due_at))  # type: ignore[union-attr]
    h.send(f.stopped(), f.start(), f.exited(generation=2, exit_code=0))
    h.send(f.restart(), f.exited(generation=3, exit_code=2))
    h.send(f.suspend(), f.suspended(generation=3), f.resume())
    h.send(f.delete(), f.deleted(generation=4))
    # Credential rotation: a skip (Stopped), a restart, and the restart's failed launch.
    h.send(f.create("rot", providers=["gh"]), f.running("rot"), f.stop("rot"))
    h.send(f.stopped("rot"), f.rotate("rot", {"gh": 2}), f.start("rot"), f.running("rot", 2))
    h.send(f.rotate("rot", {"gh": 3}), f.failed("rot", 3, "launch"))
    # The operator lifecycle: hold, extend, every deadline, expiry.
    h.send(f.create(key="t", ttl_seconds=5, on_exit="delete"), f.hold(key="t"))
    h.send(f.release(key="t"), f.extend(key="t", ttl_seconds=9, occurred_at=f.at(1)))
    h.send(f.due("t", "launch", h.row("t").deadline.due_at))  # type: ignore[union-attr]
    h.send(f.due("t", "delete", h.row("t").deadline.due_at))  # type: ignore[union-attr]
    h.send(f.create(key="u", ttl_seconds=5), f.running(key="u"))
    h.send(f.due("u", "ttl", h.row("u").expires_at))  # type: ignore[arg-type]
    h.send(f.due("u", "stop", h.row("u").deadline.due_at))  # type: ignore[union-attr]
    # The restart policy: set, an exit it schedules a restart after, the restart, the limit.
    h.send(f.create(key="r"), f.set_restart_policy("r", max_restarts=1), f.exited("r", exit_code=1))
    h.send(f.due("r", "restart", h.row("r").deadline.due_at))  # type: ignore[union-attr]
    h.send(f.exited("r", generation=2, exit_code=1))
    # Claims: an adoption, its name bound, one abandoned, a name released.
    h.send(f.create("p-1", pool="p"), f.running("p-1"), f.create("p-2", pool="p"))
    h.send(f.running("p-2"), f.create("taken"))
    h.send(f.adopt("p-1", "mine", "c1", labels={"team": "a"}), f.adopt("p-2", "taken", "c2"))
    h.send(*h.sent())
    h.send(*h.sent()[2:], f.delete("p-1"), f.deleted("p-1"))
    h.send(*h.sent()[3:])
    return h.events()


@pytest.mark.parametrize(
    ("adapter", "union", "messages"),
    [
        pytest.param(COMMANDS, Command, all_commands(), id="commands"),
        pytest.param(OBSERVATIONS, Observation, all_observations(), id="observations"),
        pytest.param(EVENTS, DecidedEvent, all_events(), id="events"),
    ],
)
def test_round_trip_of_every_type(
    adapter: TypeAdapter[Any], union: Any, messages: list[BaseModel]
) -> None:
    assert {type(m) for m in messages} == members(union)
    for message in messages:
        raw = encode(message)
        back = decode(adapter, raw)
        assert type(back) is type(message)
        assert back == message
        assert encode(back) == raw


def test_round_trip_of_outcome_and_dead_letter() -> None:
    outcome = CommandOutcome(
        command_id="c-1",
        key="sbx-1",
        command_type="StopSandbox",
        status="rejected",
        code="FAILED_PRECONDITION",
        message="sandbox must be Ready to stop (current phase: Deleting)",
        sandbox_id=uuid4(),
        phase=Phase.DELETING,
        generation=2,
        version=7,
        identity="rid-x",
    )
    letter = dead_letter(
        "field 'key': String should match pattern", "sandbox.commands", 1, 5, f.T0, None, b"{}"
    )
    for model in (outcome, letter):
        adapter: TypeAdapter[Any] = TypeAdapter(type(model))
        assert decode(adapter, encode(model)) == model


# ---------------------------------------------------------------------------------------------
# Strict validation: every refusal names the field

CREATE: dict[str, Any] = json.loads(encode(f.create(command_id="c-1", providers=["gh"])))
START: dict[str, Any] = json.loads(encode(f.start(command_id="c-2", expected_version=1)))
SNAPSHOT: dict[str, Any] = json.loads(encode(f.snapshot(observation_id="o-1")))
RESULT: dict[str, Any] = json.loads(encode(f.failed(observation_id="o-2", observed="exited")))
EVENT: dict[str, Any] = json.loads(encode(all_events()[0]))


def patched(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``body`` with the dotted ``path`` set to ``value`` (``...`` deletes it)."""
    out = json.loads(json.dumps(body))
    *parents, last = path.split(".")
    node = out
    for part in parents:
        node = node[part]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return out


BAD = [
    # (adapter, body, expected reason prefix)
    pytest.param(
        COMMANDS,
        patched(CREATE, "type", "CreateSandboxes"),
        "field 'type': unknown message type 'CreateSandboxes' (expected one of 'CreateSandbox'",
        id="unknown-type",
    ),
    pytest.param(
        OBSERVATIONS,
        patched(SNAPSHOT, "type", "Telemetry"),
        "field 'type': unknown message type 'Telemetry'",
        id="unknown-observation-type",
    ),
    pytest.param(
        COMMANDS, patched(CREATE, "type", ...), "field 'type': Field required", id="no-type"
    ),
    pytest.param(
        COMMANDS,
        patched(CREATE, "surprise", 1),
        "field 'surprise': Extra inputs are not permitted",
        id="extra-field",
    ),
    pytest.param(
        COMMANDS,
        patched(CREATE, "spec.cpu", 2),
        "field 'spec.cpu': Extra inputs are not permitted",
        id="extra-nested-field",
    ),
    pytest.param(
        COMMANDS,
        patched(START, "provider", "gh"),
        "field 'provider': Extra inputs are not permitted",
        id="field-of-another-type",
    ),
    pytest.param(
        COMMANDS,
        patched(CREATE, "spec.image", ...),
        "field 'spec.image': Field required",
        id="missing",
    ),
    pytest.param(
        COMMANDS,
        patched(START, "command_id", ...),
        "field 'command_id': Field required",
        id="no-id",
    ),
    pytest.param(
        OBSERVATIONS,
        patched(SNAPSHOT, "generation", ...),
        "field 'generation': Field required",
        id="missing-generation",
    ),
    pytest.param(
        COMMANDS,
        patched(CREATE, "spec.image", 5),
        "field 'spec.image': Input should be a valid string",
        id="wrong-type",
    ),
    pytest.param(
        COMMANDS,
        patched(CREATE, "providers", "gh"),
        "field 'providers': Input should be a valid array",
        id="wrong-type-list",
    ),
    pytest.param(
        COMMANDS,
        patched(START, "expected_version", "1"),
        "field 'expected_version': Input should be a valid integer",
        id="numeric-string-for-int",
    ),
    pytest.param(
        COMMANDS,
        patched(START, "expected_version", True),
        "field 'expected_version': Input should be a valid integer",
        id="bool-for-int",
    ),
    pytest.param(
        COMMANDS,
        patched(START, "expected_version", -1),
        "field 'expected_version': Input should be greater than or equal to 0",
        id="negative-version",
    ),
    pytest.param(
        OBSERVATIONS,
        patched(SNAPSHOT, "generation", "two"),
        "field 'generation': Input should be a valid integer",
        id="wrong-type-generation",
    ),
    pytest.param(
        OBSERVATIONS,
        patched(SNAPSHOT, "generation", 0),
        "field 'generation': Input should be greater than or equal to 1",
        id="generation-zero",
    ),
    pytest.param(
        OBSERVATIONS,
        patched(RESULT, "retryable", "yes"),
        "field 'retryable': Input should be a valid boolean",
        id="string-for-bool",
    ),
    pytest.param(
        OBSERVATIONS,
        patched(SNAPSHOT, "state", "paused"),
        "field 'state': Input should be 'created', 'running', 'stopping' or 'exited'",
        id="bad-literal",
    ),
    pytest.param(
        OBSERVATIONS,
        patched(RESULT, "observed", "gone"),
        "field 'observed': Input should be",
        id="bad-observed",
    ),
    pytest.param(
        EVENTS,
        patched(EVENT, "sandbox_id", "not-a-uuid"),
        "field 'sandbox_id': Input should be a valid UUID",
        id="bad-uuid",
    ),
    pytest.param(
        COMMANDS,
        patched(CREATE, "schema_version", 2),
        "field 'schema_version': Input should be 1",
        id="schema-version",
    ),
    pytest.param(
        COMMANDS,
        patched(CREATE, "spec.env", {"1BAD": "x"}),
        "field 'spec.env': Value error, invalid environment variable name '1BAD'",
        id="bad-env-name",
    ),
    pytest.param(
        COMMANDS,
        patched(CREATE, "spec.env", {"OK\n": "x"}),
        "field 'spec.env': Value error, invalid environment variable name",
        id="env-name-trailing-newline",
    ),
    pytest.param(
        COMMANDS,
        patched(CREATE, "spec.labels", {"team\n": "x"}),
        "field 'spec.labels': Value error, invalid label name",
        id="label-name-trailing-newline",
    ),
    pytest.param(
        COMMANDS,
        patched(START, "command_id", "has space"),
        "field 'command_id': String should match pattern",
        id="bad-command-id",
    ),
    pytest.param(
        OBSERVATIONS,
        patched(SNAPSHOT, "occurred_at", "2025-01-01T12:00:00"),
        "field 'occurred_at': Input should have timezone info",
        id="naive-observation-timestamp",
    ),
    pytest.param(
        EVENTS,
        patched(EVENT, "cause.offset", -1),
        "field 'cause.offset': Input should be greater than or equal to 0",
        id="nested-cause",
    ),
    pytest.param(
        EVENTS,
        patched(EVENT, "occurred_at", "2025-01-01T12:00:00"),
        "field 'occurred_at': Input should have timezone info",
        id="naive-event-timestamp",
    ),
]


@pytest.mark.parametrize(("adapter", "body", "reason"), BAD)
def test_invalid_messages_are_refused_naming_the_field(
    adapter: TypeAdapter[Any], body: dict[str, Any], reason: str
) -> None:
    with pytest.raises(DecodeError) as caught:
        decode(adapter, json.dumps(body).encode())
    assert caught.value.reason.startswith(reason), caught.value.reason
    assert str(caught.value) == caught.value.reason


@pytest.mark.parametrize(
    "name",
    ["Bad_Name", "UPPER", "-lead", "trail-", "a" * 64, "has space", "", "dots.not.ok", "abc\n"],
)
def test_bad_sandbox_names_are_refused(name: str) -> None:
    for adapter, body in ((COMMANDS, CREATE), (OBSERVATIONS, SNAPSHOT)):
        with pytest.raises(DecodeError) as caught:
            decode(adapter, json.dumps(patched(body, "key", name)))
        assert caught.value.reason.startswith("field 'key': String should match pattern")


@pytest.mark.parametrize("name", ["a", "0", "sbx-1", "a" * 63, "x-y-z-9"])
def test_good_sandbox_names_are_accepted(name: str) -> None:
    assert decode(COMMANDS, json.dumps(patched(CREATE, "key", name))).key == name


@pytest.mark.parametrize(
    "stamp", ["2025-01-01T12:00:00", "2025-01-01 12:00:00", "2025-01-01T12:00:00.123456"]
)
def test_naive_timestamps_are_refused(stamp: str) -> None:
    with pytest.raises(DecodeError) as caught:
        decode(COMMANDS, json.dumps(patched(START, "occurred_at", stamp)))
    assert caught.value.reason == "field 'occurred_at': Input should have timezone info"


def test_numbers_are_not_timestamps() -> None:
    with pytest.raises(DecodeError) as caught:
        decode(COMMANDS, json.dumps(patched(START, "occurred_at", 1_700_000_000)))
    assert caught.value.reason.startswith("field 'occurred_at': ")


def test_aware_timestamps_in_any_offset_are_accepted() -> None:
    body = patched(START, "occurred_at", "2025-01-01T13:00:00+01:00")
    assert decode(COMMANDS, json.dumps(body)).occurred_at == f.T0


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (None, "empty record value"),
        (b"", "empty record value"),
        (b"{not json", "not valid JSON: "),
        (b"[]", "field '<root>': "),
        (b"null", "field '<root>': "),
    ],
)
def test_unparseable_records(raw: bytes | None, reason: str) -> None:
    with pytest.raises(DecodeError) as caught:
        decode(COMMANDS, raw)
    assert caught.value.reason.startswith(reason)


def test_many_errors_are_summarized() -> None:
    body = {"type": "CreateSandbox", "surprise": 1}
    with pytest.raises(DecodeError) as caught:
        decode(COMMANDS, json.dumps(body))
    reason = caught.value.reason
    assert reason.startswith("field 'command_id': Field required; ")
    assert reason.endswith("and 1 more")  # 5 missing fields and an extra one: 5 named


def test_check_key() -> None:
    check_key(b"sbx-1", "sbx-1")
    with pytest.raises(DecodeError) as caught:
        check_key(b"other", "sbx-1")
    assert caught.value.reason == "record key 'other' does not match body key 'sbx-1'"
    with pytest.raises(DecodeError) as caught:
        check_key(None, "sbx-1")
    assert caught.value.reason == "record key None does not match body key 'sbx-1'"
    with pytest.raises(DecodeError):
        check_key(b"\xff", "sbx-1")


# ---------------------------------------------------------------------------------------------
# Exported JSON Schemas


def test_committed_json_schemas_are_current() -> None:
    names = schema_export.stale()
    assert not names, (
        f"docs/schemas/ is stale ({', '.join(names)}): regenerate it with "
        f"`{schema_export.REGENERATE}` (from the repository root) and commit the result"
    )


UNIONS = {"commands.json": Command, "observations.json": Observation, "events.json": DecidedEvent}


def test_json_schema_files_are_canonical() -> None:
    for name, text in schema_export.rendered().items():
        schema = json.loads(text)
        assert text == json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert schema["title"].startswith("sandstream ")
        union = UNIONS.get(name)
        if union is not None:
            mapping = schema["discriminator"]["mapping"]
            assert set(mapping) == {m.__name__ for m in members(union)}
    assert set(schema_export.ADAPTERS) == {
        "commands.json",
        "observations.json",
        "events.json",
        "outcome.json",
        "deadletter.json",
    }


def test_schema_export_check_and_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert schema_export.main(["--check", "--dir", str(tmp_path)]) == 1
    assert "python -m events.schema_export" in capsys.readouterr().err
    assert schema_export.main(["--dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(schema_export.ADAPTERS)
    assert schema_export.main(["--check", "--dir", str(tmp_path)]) == 0
    (tmp_path / "events.json").write_text("{}\n")
    assert schema_export.main(["--check", "--dir", str(tmp_path)]) == 1
    assert "events.json" in capsys.readouterr().err
    assert schema_export.write(tmp_path) == ["events.json"]
    assert schema_export.stale(tmp_path) == []
