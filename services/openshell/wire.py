"""Which OpenShell protocol generation sent a request: decided per message, from its bytes.

OpenShell 0.1 changed some request fields in place: a ``WorkspaceSelector`` message in the tag
of the old ``workspace`` string, a ``page_token`` string in the tag of the old ``offset``
integer, a bool where a string was. Both generations call the same method paths, so the
server reads each request's fields (their numbers and wire types, without a schema), those
of its nested messages too, and compares them with the two vendored schemas:

- a field only the new schema declares (``request_id``, ``workspace_scope`` at a new tag,
  ``allow_missing``, ``execution_timeout``...) says 0.1; one only the old schema declares
  (``timeout_seconds``, ``limit``...) says 0.0;
- a tag both declare with different types is decided by the wire type (a varint is not a
  length-delimited field), and a string-or-message tag by its payload: an encoded selector
  starts with a field key (a control byte), which no workspace name does.

A request with no such evidence reads the same under both schemas and is taken as 0.0; the
fields whose meaning changed without a change of type (field 1 of Watch, Exec and logs: an id
in 0.0, a name in 0.1) are resolved by value, not here. Pure functions, no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from google.protobuf import empty_pb2, message_factory, unknown_fields
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

OldT = TypeVar("OldT", bound=Message)
NewT = TypeVar("NewT", bound=Message)

_VARINT, _LEN = 0, 2
_LENGTH_DELIMITED: Final = frozenset(
    {FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE}
)


class Generation(enum.Enum):
    """``V0_0``: cf9d7ef7 and the 0.0.x SDKs; ``V0_1``: the 0.1.x SDKs."""

    V0_0 = "0.0"
    V0_1 = "0.1"


class Malformed(ValueError):
    """Bytes that are no message of either generation: INVALID_ARGUMENT."""


@dataclass(frozen=True, slots=True)
class Field:
    number: int
    wire_type: int
    payload: bytes | None  # the bytes of a length-delimited field, else None


def top_fields(raw: bytes) -> list[Field]:
    """The top-level fields of an encoded message, schema-free."""
    try:
        holder = empty_pb2.Empty.FromString(raw)
    except DecodeError as exc:
        raise Malformed(f"not a protobuf message: {exc}") from None
    found = []
    unknown = unknown_fields.UnknownFieldSet(holder)
    for index in range(len(unknown)):
        item = unknown[index]
        payload = item.data if item.wire_type == _LEN else None
        found.append(Field(item.field_number, item.wire_type, payload))
    return found


def _wire_type(field: FieldDescriptor) -> int | None:
    if field.is_repeated and field.type not in _LENGTH_DELIMITED:
        return None  # packed or not: either wire type may come
    if field.type in _LENGTH_DELIMITED:
        return _LEN
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FIXED64,
                      FieldDescriptor.TYPE_SFIXED64):  # fmt: skip
        return 1
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_FIXED32,
                      FieldDescriptor.TYPE_SFIXED32):  # fmt: skip
        return 5
    return _VARINT


def _is_message(payload: bytes, descriptor: Descriptor) -> bool:
    """An encoded message of that type, and not a printable string (a name never starts with
    a control byte; a non-empty message always does: its first field key)."""
    if not payload or payload[0] >= 0x20:
        return False
    try:
        message_factory.GetMessageClass(descriptor).FromString(payload)
    except DecodeError:
        return False
    return True


def _evidence(field: Field, old: Descriptor, new: Descriptor) -> Generation | None:
    in_old = old.fields_by_number.get(field.number)
    in_new = new.fields_by_number.get(field.number)
    if in_old is None and in_new is None:
        return None
    if in_old is None:
        return Generation.V0_1
    if in_new is None:
        return Generation.V0_0
    if in_old.type == in_new.type:
        return None
    old_wire, new_wire = _wire_type(in_old), _wire_type(in_new)
    if old_wire != new_wire and field.wire_type in (old_wire, new_wire):
        return Generation.V0_0 if field.wire_type == old_wire else Generation.V0_1
    if field.payload is not None:
        for side, descriptor in ((Generation.V0_1, in_new), (Generation.V0_0, in_old)):
            if descriptor.type == FieldDescriptor.TYPE_MESSAGE and descriptor.message_type:
                message = _is_message(field.payload, descriptor.message_type)
                return side if message else _other(side)
    return None


def _other(side: Generation) -> Generation:
    return Generation.V0_0 if side is Generation.V0_1 else Generation.V0_1


# The deepest nesting read for evidence, as protobuf's own parser (upb) reads no deeper: a
# request nesting google.protobuf.Struct thousands deep overflowed the C stack and ended the
# process (a segmentation fault), before the check of the nesting was bounded.
MAX_DEPTH: Final = 100


def _votes(raw: bytes, old: Descriptor, new: Descriptor, depth: int = 0) -> set[Generation]:
    """The evidence of every field of ``raw``, and of the fields of each message field both
    schemas declare as a message (a 0.1-only field inside ``spec`` or ``provider`` says 0.1
    as a top-level one does)."""
    if depth > MAX_DEPTH:
        raise Malformed(f"the request nests messages deeper than {MAX_DEPTH}")
    votes: set[Generation] = set()
    for found in top_fields(raw):
        if (evidence := _evidence(found, old, new)) is not None:
            votes.add(evidence)
            continue
        in_old = old.fields_by_number.get(found.number)
        in_new = new.fields_by_number.get(found.number)
        if (
            found.payload is not None
            and in_old is not None
            and in_new is not None
            and in_old.message_type is not None
            and in_new.message_type is not None
        ):
            votes |= _votes(found.payload, in_old.message_type, in_new.message_type, depth + 1)
    return votes


def generation_of(raw: bytes, old: Descriptor, new: Descriptor) -> Generation:
    """The generation whose schema ``raw`` was written with (0.0 when both read it alike)."""
    votes = _votes(raw, old, new)
    if len(votes) > 1:
        raise Malformed("the request mixes fields of OpenShell 0.0 and 0.1")
    return votes.pop() if votes else Generation.V0_0


@dataclass(frozen=True, slots=True)
class Decoded(Generic[OldT, NewT]):
    generation: Generation
    old: OldT | None  # set for 0.0
    new: NewT | None  # set for 0.1


def decode(raw: bytes, old: type[OldT], new: type[NewT]) -> Decoded[OldT, NewT]:
    """The request parsed with the schema of the generation that wrote it."""
    generation = generation_of(raw, old.DESCRIPTOR, new.DESCRIPTOR)  # type: ignore[arg-type]
    try:
        if generation is Generation.V0_1:
            return Decoded(generation, None, new.FromString(raw))
        return Decoded(generation, old.FromString(raw), None)
    except DecodeError as exc:
        raise Malformed(f"malformed {old.DESCRIPTOR.name}: {exc}") from None
