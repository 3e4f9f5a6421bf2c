"""The history's hash chain, pure: every content field is covered, chains continue from their
heads, unkeyed entries chain per partition."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from uuid import UUID

import pytest
from asyncpg.pgproto.pgproto import UUID as PgUUID
from hypothesis import given
from hypothesis import strategies as st
from pydantic import AwareDatetime, TypeAdapter

from projections.chain import CONTENT_FIELDS, canonical, chain_of, chain_rows, link
from projections.store import HistoryRow


def entry(key: str | None = "a", offset: int = 0, partition: int = 0) -> HistoryRow:
    return HistoryRow(
        key=key, topic="sandbox.commands", partition=partition, offset=offset,
        message_type="StopSandbox", command_id="c", disposition="applied", reason="why",
        phase="Stopping", generation=1, version=3, event_types=["SandboxStopping"],
        message='{"type": "StopSandbox"}', occurred_at=datetime(2026, 1, 1, tzinfo=UTC),
        sandbox_id=UUID(int=1),
    )  # fmt: skip


CHANGED = {
    "key": "b", "topic": "sandbox.observations", "partition": 1, "offset": 1,
    "message_type": "StartSandbox", "command_id": "d", "disposition": "rejected",
    "reason": "other", "phase": "Ready", "generation": 2, "version": 4,
    "event_types": [], "message": '{"type": "StartSandbox"}',
    "occurred_at": datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC), "sandbox_id": UUID(int=2),
}  # fmt: skip


@pytest.mark.parametrize("name", CONTENT_FIELDS)
def test_every_content_field_is_covered_by_the_hash(name: str) -> None:
    original = entry()
    altered = dataclasses.replace(original, **{name: CHANGED[name]})
    content = {n: getattr(original, n) for n in CONTENT_FIELDS}
    assert link(None, content) != link(None, content | {name: getattr(altered, name)})


def test_the_same_instant_in_another_zone_hashes_the_same() -> None:
    here = entry()
    assert here.occurred_at is not None
    there = dataclasses.replace(
        here, occurred_at=here.occurred_at.astimezone(timezone(timedelta(hours=2)))
    )
    assert chain_rows([here], {}) == [
        dataclasses.replace(r, occurred_at=here.occurred_at) for r in chain_rows([there], {})
    ]


def test_chains_continue_from_their_heads_and_unkeyed_entries_chain_per_partition() -> None:
    head = b"h" * 32
    rows = chain_rows(
        [entry("a", 0), entry(None, 1, partition=3), entry("a", 2), entry(None, 3, partition=4)],
        {chain_of("a", 0): head},
    )
    assert rows[0].prev_hash == head
    assert rows[2].prev_hash == rows[0].entry_hash
    assert rows[1].prev_hash is None and rows[3].prev_hash is None  # two chains, by partition
    assert len({r.entry_hash for r in rows}) == 4


def reference_canonical(content: dict[str, Any]) -> bytes:
    """The canonical bytes as first defined: json.dumps, sorted keys, compact, not ASCII-only."""
    occurred, sandbox_id = content["occurred_at"], content["sandbox_id"]
    body = content | {
        "event_types": list(content["event_types"]),
        "occurred_at": occurred.astimezone(UTC).isoformat(timespec="microseconds")
        if occurred is not None
        else None,
        "sandbox_id": str(sandbox_id) if sandbox_id is not None else None,
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


text = st.text(st.characters(blacklist_categories=("Cs",)))  # what PostgreSQL text can hold
maybe_int = st.none() | st.integers(min_value=-(2**63), max_value=2**63 - 1)


@given(
    key=st.none() | text, message=st.none() | text, reason=text, message_type=st.none() | text,
    command_id=st.none() | text, phase=st.none() | text, event_types=st.lists(text),
    generation=maybe_int, version=maybe_int, offset=st.integers(0, 2**63 - 1),
    partition=st.integers(0, 2**31 - 1), topic=text,
    occurred_at=st.none() | st.datetimes(timezones=st.timezones()),
    sandbox_id=st.none() | st.uuids(),
)  # fmt: skip
def test_the_canonical_bytes_are_those_json_dumps_writes(**content: Any) -> None:
    content["disposition"] = "applied"
    assert canonical(content) == reference_canonical(content)


@pytest.mark.parametrize(
    "occurred",
    ["2026-01-01T00:00:00Z", "2026-01-01T00:00:00.5+00:00", "2026-01-01T02:00:00+02:00",
     "2026-01-01T00:00:00-00:30"],
)  # fmt: skip
def test_times_and_ids_as_the_codec_decodes_them_hash_as_first_defined(occurred: str) -> None:
    """The log's times carry pydantic-core's own tzinfo (and asyncpg's ids its own UUID type):
    a time at offset zero is written without converting it, and must read as converted."""
    at = TypeAdapter(AwareDatetime).validate_json(json.dumps(occurred))
    assert type(at.tzinfo) is not type(UTC)  # not the standard library's
    for sandbox_id in (UUID(int=7), PgUUID(str(UUID(int=7)))):
        content = {**CHANGED, "occurred_at": at, "sandbox_id": sandbox_id, "disposition": "x"}
        assert canonical(content) == reference_canonical(content)


def test_content_of_a_type_json_cannot_write_is_refused_not_hashed_as_its_text() -> None:
    with pytest.raises(TypeError, match="bytes"):
        canonical({**CHANGED, "sandbox_id": b"\x00" * 16, "disposition": "x"})
