"""The reads of the API's pages: a sandbox, the list (keyset pages on the name), a name's
history, and the input offsets the processor has stored (readiness)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from events.common import INT64_MAX, Phase
from services.api.readmodel.horizon import change_horizon
from services.api.readmodel.pages import (
    decode_page_token,
    encode_page_token,
    page_position,
    parse_label_filters,
)
from services.api.readmodel.views import (
    HISTORY_COLUMNS,
    VIEW_COLUMNS,
    HistoryEntry,
    HistoryPage,
    Row,
    SandboxList,
    SandboxView,
    history_entry,
    row_of,
    sandbox_view,
)
from services.common.database import Pool
from services.common.names import KEY_OF, resolve

# The row a name stands for: the adopted member its binding names, or its own (services.common
# .names).
_ROW_OF_NAME = f"SELECT {VIEW_COLUMNS} FROM sandboxes WHERE key = {KEY_OF.format('$1::text')}"


async def get_sandbox(pool: Pool, name: str, include_deleted: bool = False) -> SandboxView | None:
    """The live row of ``name`` (or its tombstone, when asked for); None for an unknown name.
    A name bound to an adopted pool member answers with the member's row."""
    record = await pool.fetchrow(
        f"{_ROW_OF_NAME} AND ($2 OR phase <> 'Deleted')", name, include_deleted
    )
    return sandbox_view(record) if record is not None else None


async def get_row(pool: Pool, name: str) -> Row | None:
    """The row of ``name`` as stored (also a tombstone), and its position in the change feed;
    the adopted member's for a bound name."""
    record = await pool.fetchrow(_ROW_OF_NAME, name)
    return row_of(record) if record is not None else None


async def sandbox_exists(pool: Pool, name: str) -> bool:
    """Whether the name has a row at all (a live sandbox or a tombstone)."""
    return bool(await pool.fetchval("SELECT EXISTS (SELECT 1 FROM sandboxes WHERE key = $1)", name))


async def list_sandboxes(
    pool: Pool,
    *,
    phases: Sequence[Phase] = (),
    labels: Sequence[str] = (),
    include_deleted: bool = False,
    limit: int = 100,
    page_token: str | None = None,
) -> SandboxList:
    equal, present = parse_label_filters(labels)
    wanted = sorted({p.value for p in phases})
    # Tombstones only when asked for: by include_deleted or by filtering on phase Deleted.
    deleted_ok = include_deleted or Phase.DELETED.value in wanted
    filters = {"phase": wanted, "eq": equal, "has": present, "deleted": deleted_ok}
    after = decode_page_token(page_token, "sandboxes", filters) if page_token else None
    if after is not None:
        after = page_position("page_token", after, str)
    query, args = list_query(wanted, deleted_ok, equal, present, after, limit + 1)
    async with pool.acquire() as conn:
        cursor = await change_horizon(conn)
        records = await conn.fetch(query, *args)
    items = [sandbox_view(r) for r in records[:limit]]
    token = None
    if len(records) > limit:  # pages follow the key (an adopted member's name is another)
        token = encode_page_token("sandboxes", filters, items[-1].member_key)
    return SandboxList(items=items, next_page_token=token, cursor=cursor or 0)


def list_query(
    phases: list[str],
    deleted_ok: bool,
    equal: dict[str, str],
    present: list[str],
    after: str | None,
    limit: int,
) -> tuple[str, list[Any]]:
    """A page of the list: the statement, with the filters given only, and its arguments. A
    filter written to hold when not given (an empty label set) still counted in the planner's
    estimate of the matching rows: each page then sorted the whole table instead of walking
    the key index from where it starts (tests/test_read_plans.py)."""
    # A bound name's row is a tombstone pointing at its member, which is listed itself.
    clauses = ["bound_to IS NULL"] if deleted_ok else ["phase <> 'Deleted'"]
    args: list[Any] = []
    for clause, value in (
        ("phase = ANY(${}::text[])", phases or None),
        ("(spec -> 'labels') @> ${}::jsonb", json.dumps(equal) if equal else None),
        ("(spec -> 'labels') ?& ${}::text[]", present or None),
        ("key > ${}", after),
    ):
        if value is not None:
            args.append(value)
            clauses.append(clause.format(len(args)))
    where = (" WHERE " + " AND ".join(clauses)) if clauses else ""
    args.append(limit)
    return f"SELECT {VIEW_COLUMNS} FROM sandboxes{where} ORDER BY key LIMIT ${len(args)}", args


async def history(
    pool: Pool,
    name: str,
    *,
    limit: int = 100,
    page_token: str | None = None,
    incarnation: UUID | None = None,
    generation: int | None = None,
    after: int = 0,
) -> HistoryPage | None:
    """The history of a name, oldest first; None if the name never had a row or an input.

    ``incarnation`` keeps the entries that left that incarnation's row behind (from its
    create on); ``generation`` the observations of that generation and the commands decided
    while the row was at it. ``after`` starts after that seq where no page token is given (a
    live tail's position).
    """
    # Filters that are not set stay out of the token's fingerprint (tokens of before hold).
    context: dict[str, Any] = {"name": name}
    if incarnation is not None:
        context["incarnation"] = str(incarnation)
    if generation is not None:
        context["generation"] = generation
    if page_token:
        after = decode_page_token(page_token, "history", context)
    after = page_position("page_token", after, int)
    key = await resolve(pool, name)  # a bound name: its adopted member's history
    records = await pool.fetch(
        f"SELECT {HISTORY_COLUMNS} FROM history WHERE key = $1 AND id > $2 "
        "AND ($4::uuid IS NULL OR sandbox_id = $4) "
        "AND ($5::int IS NULL OR coalesce((message->>'generation')::int, generation) = $5) "
        "ORDER BY id LIMIT $3",
        key,
        after,
        limit + 1,
        incarnation,
        generation,
    )
    if not records and after == 0 and not await sandbox_exists(pool, key):
        return None
    items = [history_entry(r) for r in records[:limit]]
    token = None
    if len(records) > limit:
        token = encode_page_token("history", context, items[-1].seq)
    return HistoryPage(name=name, items=items, next_page_token=token)


async def recent_history(
    pool: Pool, name: str, limit: int, before: int | None = None
) -> tuple[list[HistoryEntry], bool]:
    """The last ``limit`` entries of a name (before the seq ``before``), oldest first, and
    whether earlier ones exist: the history read backwards through ``history_key``."""
    records = await pool.fetch(
        f"SELECT {HISTORY_COLUMNS} FROM history WHERE key = {KEY_OF.format('$1::text')} "
        "AND id < $2 ORDER BY id DESC LIMIT $3",
        name,
        INT64_MAX if before is None else before,
        limit + 1,
    )
    items = [history_entry(r) for r in records[:limit]]
    items.reverse()
    return items, len(records) > limit


async def stored_input_offsets(pool: Pool, topics: Sequence[str]) -> dict[tuple[str, int], int]:
    records = await pool.fetch(
        "SELECT topic, partition, next_offset FROM input_offsets WHERE topic = ANY($1::text[])",
        list(topics),
    )
    return {(r["topic"], r["partition"]): r["next_offset"] for r in records}
