"""``built`` leaves a model exactly as validating construction does, for values already valid."""

from __future__ import annotations

import uuid
from typing import Any, get_args

import factories as f
import pytest
from pydantic import BaseModel, Field

from events.common import Cause, Deadline, Phase, Strict
from events.decided import AgentRestartSkipped, DecidedEvent, SandboxCreated, SandboxReady
from events.outcomes import Code, CommandOutcome
from events.trusted import builder, built
from projections.lifecycle.emit import _EVENTS, COMMON_FIELDS, common_fields, new_event
from projections.lifecycle.rows import _CHANGES

CAUSE = Cause(topic="t", partition=0, offset=7, message_type="CreateSandbox", command_id="c-1")
COMMON: dict[str, Any] = {
    "event_id": uuid.UUID(int=1),
    "key": "sbx-1",
    "sandbox_id": uuid.UUID(int=2),
    "version": 1,
    "generation": 1,
    "occurred_at": f.at(),
    "actor": "alice",
    "cause": CAUSE,
}


@pytest.mark.parametrize(
    ("cls", "values"),
    [
        (SandboxReady, {"type": "SandboxReady", **COMMON}),
        # Defaults left out (deadline, expires_at, the policies) are filled in, in field order.
        (SandboxCreated, {"type": "SandboxCreated", **COMMON, "spec": f.spec(),
                          "providers": ["gh"], "identity": "rid-1"}),
        (SandboxCreated, {"type": "SandboxCreated", **COMMON, "spec": f.spec(),
                          "providers": [], "identity": "rid-1", "on_exit": "delete",
                          "deadline": Deadline(kind="launch", due_at=f.at(300))}),
        (AgentRestartSkipped, {"type": "AgentRestartSkipped", **COMMON, "providers": ["gh"],
                               "reason": "held"}),
        (CommandOutcome, {"command_id": "c-1", "key": "sbx-1", "command_type": "StopSandbox",
                          "status": "rejected", "code": Code.NOT_FOUND, "message": "not found"}),
    ],
)  # fmt: skip
def test_built_is_what_validation_builds(cls: type[BaseModel], values: dict[str, Any]) -> None:
    ours, validated = built(cls, **values), cls(**values)
    assert ours == validated
    assert ours.model_fields_set == validated.model_fields_set == set(values)
    assert list(ours.__dict__) == list(validated.__dict__) == list(cls.model_fields)
    assert ours.model_dump_json() == validated.model_dump_json()
    f.assert_as_validated(ours)


def test_a_default_factory_gives_each_model_its_own_value() -> None:
    values = {"type": "AgentRestartSkipped", **COMMON, "providers": ["gh"], "reason": "held"}
    one, two = built(AgentRestartSkipped, **values), built(AgentRestartSkipped, **values)
    assert one.awaits == {} and one.awaits is not two.awaits


def test_unknown_and_missing_fields_are_refused() -> None:
    with pytest.raises(TypeError, match=r"unknown fields \['colour'\]"):
        built(SandboxReady, type="SandboxReady", **COMMON, colour="red")
    partial = {k: v for k, v in COMMON.items() if k != "actor"}
    with pytest.raises(TypeError, match=r"missing \['actor'\]"):
        built(SandboxReady, type="SandboxReady", **partial)


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # the tuple, dumped
def test_a_model_built_wrong_is_caught_by_the_check_the_core_tests_use() -> None:
    """The property tests' check fails for a value validation would have changed (a tuple
    where the model holds a list) or refused (a key that is no sandbox name)."""
    created = {"type": "SandboxCreated", **COMMON, "spec": f.spec(), "identity": "rid-1"}
    with pytest.raises(AssertionError):
        f.assert_as_validated(built(SandboxCreated, **created, providers=("gh",)))
    with pytest.raises(ValueError, match="key"):
        f.assert_as_validated(built(SandboxReady, type="SandboxReady", **{**COMMON, "key": "A_"}))


def test_models_built_needs_to_resolve_are_refused() -> None:
    class Aliased(Strict):
        name: str = Field(alias="n")

    class Loose(BaseModel):
        name: str

    with pytest.raises(TypeError, match="aliases"):
        built(Aliased, name="x")
    with pytest.raises(TypeError, match="extra='forbid'"):
        built(Loose, name="x")


def test_every_decided_event_but_the_creation_has_its_row_changes() -> None:
    """evolve looks an event's changes up by its type: none may be missing."""
    (union, _) = get_args(DecidedEvent)
    assert set(get_args(union)) - {SandboxCreated} == set(_CHANGES)


@pytest.mark.parametrize(
    ("cls", "values"),
    [
        (Cause, {"topic": "t", "partition": 0, "offset": 7, "message_type": "RuntimeSnapshot",
                 "command_id": None}),
        (Deadline, {"kind": "launch", "due_at": f.at(300)}),
        (Deadline, {"kind": "delete", "due_at": f.at(300), "attempt": 2}),
        (CommandOutcome, {"command_id": "c-1", "key": "sbx-1", "command_type": "StopSandbox",
                          "status": "accepted", "code": Code.OK, "message": "ok",
                          "sandbox_id": uuid.UUID(int=2), "phase": Phase.STOPPING,
                          "generation": 1, "version": 3, "identity": "rid-1"}),
        # A field left to its factory gets a fresh value each time.
        (AgentRestartSkipped, {"type": "AgentRestartSkipped", **COMMON, "providers": ["gh"],
                               "reason": "held"}),
    ],
)  # fmt: skip
def test_a_builder_builds_what_validation_builds(
    cls: type[BaseModel], values: dict[str, Any]
) -> None:
    build = builder(cls, *values)
    ours, again, validated = build(*values.values()), build(*values.values()), cls(**values)
    assert ours == validated == built(cls, **values)
    assert ours.model_fields_set == validated.model_fields_set == set(values)
    assert list(ours.__dict__) == list(validated.__dict__) == list(cls.model_fields)
    assert ours.model_dump_json() == validated.model_dump_json()
    f.assert_as_validated(ours)
    if isinstance(ours, AgentRestartSkipped) and isinstance(again, AgentRestartSkipped):
        assert ours.awaits is not again.awaits


def test_a_builder_refuses_unknown_missing_and_repeated_fields() -> None:
    with pytest.raises(TypeError, match=r"unknown fields \['colour'\]"):
        builder(Deadline, "kind", "due_at", "colour")
    with pytest.raises(TypeError, match=r"missing \['due_at'\]"):
        builder(Deadline, "kind")
    with pytest.raises(TypeError, match="named twice"):
        builder(Deadline, "kind", "due_at", "kind")
    with pytest.raises(TypeError, match="extra='forbid'"):
        builder(BaseModel)


def test_the_rules_positional_events_are_what_validation_builds() -> None:
    """The rules build their most frequent events from ``common_fields``'s values by position: its
    order is COMMON_FIELDS, and each one is what validation builds from the same names."""
    harness = f.harness_in(Phase.READY)
    row, message = harness.row(), f.running()
    common = common_fields(row, message, f.cause(message))
    assert tuple(common) == COMMON_FIELDS
    deadline = Deadline(kind="stop", due_at=f.at(40))
    for cls in _EVENTS:
        extra = {"deadline": deadline} if "deadline" in cls.model_fields else {}
        ours = new_event(cls, common, *extra.values())
        assert ours == cls(type=cls.__name__, **common, **extra)
        f.assert_as_validated(ours)
