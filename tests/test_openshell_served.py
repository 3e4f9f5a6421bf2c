"""The served schema reads correctly in both OpenShell generations: every field of every served
message has, in each vendored release that has the message, the same number with the same
type, or a number that release does not declare (it skips it)."""

from __future__ import annotations

from types import ModuleType

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from services.openshell.proto import served_pb2
from services.openshell.proto.vendored.v0_0_116 import datamodel_pb2 as dm0
from services.openshell.proto.vendored.v0_0_116 import openshell_pb2 as os0
from services.openshell.proto.vendored.v0_1_5 import datamodel_pb2 as dm1
from services.openshell.proto.vendored.v0_1_5 import openshell_pb2 as os1

RELEASES: dict[str, tuple[ModuleType, ...]] = {"0.0.116": (os0, dm0), "0.1.5": (os1, dm1)}
SERVED = sorted(served_pb2.DESCRIPTOR.message_types_by_name.values(), key=lambda d: d.name)


def counterpart(message: Descriptor, release: str) -> Descriptor | None:
    for module in RELEASES[release]:
        found = module.DESCRIPTOR.message_types_by_name.get(message.name)
        if found is not None:
            return found  # type: ignore[no-any-return]
    return None


def kind(field: FieldDescriptor) -> tuple[int, str, bool]:
    """What the wire format depends on: the type, the message/enum's name, repeated or not."""
    named = field.message_type or field.enum_type
    return field.type, named.name if named else "", field.is_repeated


PAIRS = [(r, m) for r in sorted(RELEASES) for m in SERVED if counterpart(m, r) is not None]


@pytest.mark.parametrize(("release", "message"), PAIRS, ids=lambda v: getattr(v, "name", v))
def test_every_served_field_reads_alike_in_the_release(release: str, message: Descriptor) -> None:
    theirs = counterpart(message, release)
    assert theirs is not None
    wrong = []
    for field in message.fields:
        other = theirs.fields_by_number.get(field.number)
        if other is not None and kind(other) != kind(field):
            wrong.append(f"{field.name}={field.number}: {kind(field)} vs {release} {kind(other)}")
    assert not wrong


def test_each_served_message_is_known_to_a_release_and_old_fields_survive() -> None:
    """No served message is made up, and an answer keeps what a 0.0 client reads."""
    assert all(counterpart(m, "0.1.5") or counterpart(m, "0.0.116") for m in SERVED)
    meta = served_pb2.ObjectMeta(created_at_ms=5, name="x")
    meta.created_time.FromMilliseconds(5)
    assert dm0.ObjectMeta.FromString(meta.SerializeToString()).created_at_ms == 5
    assert dm1.ObjectMeta.FromString(meta.SerializeToString()).created_time.ToMilliseconds() == 5
