"""The read side of the API: queries on the PostgreSQL projection, and nothing else.

Lists use keyset pagination on the sandbox name with an opaque ``page_token`` bound to the
filters it was issued for. The change feed (``/v1/watch``) reads rows by ``change_seq``, which
the processor bumps on every row change; ``change_horizon`` says up to which sequence number
every change is committed, so a watcher never steps over a change still being written.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, Final, Literal, TypeAlias
from uuid import UUID

import asyncpg
from pydantic import BaseModel, Field

from events.common import (
    Deadline,
    ExitPolicy,
    ExpiryPolicy,
    Hold,
    Phase,
    SandboxSpec,
)
from events.outcomes import Code, CommandOutcome
from events.topics import CHANGES_CHANNEL
from projections.store import DATABASE_ERRORS, SANDBOX_COLUMNS, sandbox_from_record

log = logging.getLogger("sandstream.api")

Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"

MAX_PAGE = 500
MAX_HISTORY_PAGE = 1000
PROGRESSING = (Phase.PROVISIONING, Phase.STARTING, Phase.STOPPING, Phase.DELETING)


class InvalidArgument(ValueError):
    """A request argument the queries cannot use; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# ---------------------------------------------------------------------------------------------
# Views


class Condition(BaseModel):
    """A yes/no summary of the phase, in the style of Kubernetes conditions."""

    type: Literal["Ready", "Progressing", "Failed"]
    status: Literal["True", "False"]
    reason: str = Field(description="the phase the condition was derived from")
    message: str = ""


class SandboxView(BaseModel):
    id: UUID = Field(description="this incarnation's stable id")
    name: str
    phase: Phase
    generation: int = Field(description="bumped by every create, start and restart")
    version: int = Field(description="+1 per accepted change; use as expected_version")
    spec: SandboxSpec
    labels: dict[str, str]
    providers: list[str]
    identity: str = Field(description="the current generation's runtime identity (not a secret)")
    conditions: list[Condition]
    exit_code: int | None
    reason: str | None = Field(description="why the sandbox is in Error (or a failed operation)")
    created_at: datetime
    updated_at: datetime
    change_seq: int = Field(description="position of this row's last change in the watch feed")
    deadline: Deadline | None = Field(
        default=None, description="the current phase's deadline (Provisioning, Starting, ...)"
    )
    expires_at: datetime | None = Field(
        default=None, description="when the time to live ends (then on_expiry applies)"
    )
    on_expiry: ExpiryPolicy = "stop"
    on_exit: ExitPolicy = Field(
        default="keep", description="delete: deleted once its main process ended"
    )
    hold: Hold | None = Field(
        default=None, description="an operator's hold: start and restart are refused"
    )


class SandboxList(BaseModel):
    items: list[SandboxView]
    next_page_token: str | None = Field(
        description="pass as page_token for the next page; absent on the last page"
    )
    cursor: int = Field(
        description="watch cursor: /v1/watch?cursor=<this> follows every change after this list"
    )


class HistoryEntry(BaseModel):
    seq: int = Field(description="position in the history (ascending)")
    topic: str
    partition: int
    offset: int
    message_type: str | None
    command_id: str | None
    disposition: str = Field(
        description="applied, idempotent, rejected, ignored, duplicate or dead-lettered"
    )
    reason: str
    phase: Phase | None
    generation: int | None
    version: int | None
    events: list[str] = Field(description="the decided events this input produced")
    message: dict[str, Any] | None = Field(description="the input message as recorded")
    occurred_at: datetime | None
    recorded_at: datetime
    sandbox_id: UUID | None = Field(
        default=None, description="the incarnation of the row after this input (null: none)"
    )


class HistoryPage(BaseModel):
    name: str
    items: list[HistoryEntry]
    next_page_token: str | None


class CommandStatus(BaseModel):
    command_id: str
    name: str
    command_type: str
    status: Literal["pending", "accepted", "rejected"]
    code: Code | None = Field(description="OK when accepted; the rejection code; null if pending")
    message: str
    sandbox_id: UUID | None = None
    phase: Phase | None = Field(default=None, description="the phase right after the decision")
    generation: int | None = None
    version: int | None = None
    identity: str | None = Field(
        default=None,
        description="the runtime identity of the sandbox's generation right after the decision "
        "(for create, start and restart: the one the command minted)",
    )


def command_status(outcome: CommandOutcome) -> CommandStatus:
    return CommandStatus(
        command_id=outcome.command_id,
        name=outcome.key,
        command_type=outcome.command_type,
        status=outcome.status,
        code=outcome.code,
        message=outcome.message,
        sandbox_id=outcome.sandbox_id,
        phase=outcome.phase,
        generation=outcome.generation,
        version=outcome.version,
        identity=outcome.identity,
    )


def pending_status(command_id: str, name: str, command_type: str, message: str) -> CommandStatus:
    return CommandStatus(
        command_id=command_id,
        name=name,
        command_type=command_type,
        status="pending",
        code=None,
        message=message,
    )


def conditions(phase: Phase, reason: str | None) -> list[Condition]:
    def cond(kind: Literal["Ready", "Progressing", "Failed"], on: bool, msg: str = "") -> Condition:
        return Condition(type=kind, status="True" if on else "False", reason=phase.value,
                         message=msg)  # fmt: skip

    return [
        cond("Ready", phase is Phase.READY),
        cond("Progressing", phase in PROGRESSING),
        cond("Failed", phase is Phase.ERROR, reason or ""),
    ]


def sandbox_view(record: Any) -> SandboxView:
    s = sandbox_from_record(record)
    return SandboxView(
        id=s.sandbox_id,
        name=s.key,
        phase=s.phase,
        generation=s.generation,
        version=s.version,
        spec=s.spec,
        labels=dict(s.spec.labels),
        providers=list(s.providers),
        identity=s.identity,
        conditions=conditions(s.phase, s.reason),
        exit_code=s.exit_code,
        reason=s.reason,
        created_at=s.created_at,
        updated_at=s.updated_at,
        change_seq=record["change_seq"],
        deadline=s.deadline,
        expires_at=s.expires_at,
        on_expiry=s.on_expiry,
        on_exit=s.on_exit,
        hold=s.hold,
    )


# ---------------------------------------------------------------------------------------------
# Page tokens: opaque to clients, bound to the query they continue


def _fingerprint(scope: str, filters: Any) -> str:
    raw = json.dumps([scope, filters], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def encode_page_token(scope: str, filters: Any, after: str | int) -> str:
    body = json.dumps({"a": after, "f": _fingerprint(scope, filters)}, separators=(",", ":"))
    return base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")


INT64_MAX: Final = 2**63 - 1


def plain_text(field: str, value: str) -> str:
    """``value`` if PostgreSQL can take it as text (no NUL character), else InvalidArgument."""
    if "\x00" in value:
        raise InvalidArgument(field, "must not contain NUL characters")
    return value


def page_position(field: str, value: Any, kind: type[str] | type[int]) -> Any:
    """A decoded page token's position, checked: a NUL-free name or an int64 sequence number."""
    if kind is str and isinstance(value, str) and "\x00" not in value and len(value) <= 253:
        return value
    if kind is int and type(value) is int and 0 <= value <= INT64_MAX:
        return value
    raise InvalidArgument(field, "malformed page token")


def decode_page_token(token: str, scope: str, filters: Any) -> Any:
    try:
        padded = token + "=" * (-len(token) % 4)
        body = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
        after, fingerprint = body["a"], body["f"]
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeError):
        raise InvalidArgument("page_token", "malformed page token") from None
    if fingerprint != _fingerprint(scope, filters):
        raise InvalidArgument(
            "page_token", "the page token was issued for a different query (filters changed)"
        )
    return after


# ---------------------------------------------------------------------------------------------
# Label filters: "key=value" (equal) or "key" (present)


def parse_label_filters(values: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    equal: dict[str, str] = {}
    present: list[str] = []
    for item in values:
        key, sep, value = plain_text("label", item).partition("=")
        if not key:
            raise InvalidArgument("label", f"expected key=value or key, got {item!r}")
        if sep:
            if key in equal and equal[key] != value:
                raise InvalidArgument("label", f"conflicting filters for label {key!r}")
            equal[key] = value
        else:
            present.append(key)
    return equal, sorted(set(present))


# ---------------------------------------------------------------------------------------------
# Queries


_ROW = f"{SANDBOX_COLUMNS}, change_seq"


async def get_sandbox(pool: Pool, name: str) -> SandboxView | None:
    """The live row of ``name``; None for an unknown name or a tombstone."""
    record = await pool.fetchrow(
        f"SELECT {_ROW} FROM sandboxes WHERE key = $1 AND phase <> 'Deleted'", name
    )
    return sandbox_view(record) if record is not None else None


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
    query, args = _list_query(wanted, deleted_ok, equal, present, after, limit + 1)
    async with pool.acquire() as conn:
        cursor = await change_horizon(conn)
        records = await conn.fetch(query, *args)
    items = [sandbox_view(r) for r in records[:limit]]
    token = None
    if len(records) > limit:
        token = encode_page_token("sandboxes", filters, items[-1].name)
    return SandboxList(items=items, next_page_token=token, cursor=cursor or 0)


def _list_query(
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
    clauses = [] if deleted_ok else ["phase <> 'Deleted'"]
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
    return f"SELECT {_ROW} FROM sandboxes{where} ORDER BY key LIMIT ${len(args)}", args


async def history(
    pool: Pool,
    name: str,
    *,
    limit: int = 100,
    page_token: str | None = None,
    incarnation: UUID | None = None,
    generation: int | None = None,
) -> HistoryPage | None:
    """The history of a name, oldest first; None if the name never had a row or an input.

    ``incarnation`` keeps the entries that left that incarnation's row behind (from its
    create on); ``generation`` the observations of that generation and the commands decided
    while the row was at it.
    """
    # Filters that are not set stay out of the token's fingerprint (tokens of before hold).
    context: dict[str, Any] = {"name": name}
    if incarnation is not None:
        context["incarnation"] = str(incarnation)
    if generation is not None:
        context["generation"] = generation
    after = decode_page_token(page_token, "history", context) if page_token else 0
    after = page_position("page_token", after, int)
    records = await pool.fetch(
        'SELECT id, topic, partition, "offset", message_type, command_id, disposition, reason, '
        "phase, generation, version, event_types, message, occurred_at, recorded_at, sandbox_id "
        "FROM history WHERE key = $1 AND id > $2 "
        "AND ($4::uuid IS NULL OR sandbox_id = $4) "
        "AND ($5::int IS NULL OR coalesce((message->>'generation')::int, generation) = $5) "
        "ORDER BY id LIMIT $3",
        name,
        after,
        limit + 1,
        incarnation,
        generation,
    )
    if not records and after == 0 and not await sandbox_exists(pool, name):
        return None
    items = [
        HistoryEntry(
            seq=r["id"],
            topic=r["topic"],
            partition=r["partition"],
            offset=r["offset"],
            message_type=r["message_type"],
            command_id=r["command_id"],
            disposition=r["disposition"],
            reason=r["reason"],
            phase=Phase(r["phase"]) if r["phase"] else None,
            generation=r["generation"],
            version=r["version"],
            events=list(r["event_types"]),
            message=json.loads(r["message"]) if r["message"] is not None else None,
            occurred_at=r["occurred_at"],
            recorded_at=r["recorded_at"],
            sandbox_id=r["sandbox_id"],
        )
        for r in records[:limit]
    ]
    token = None
    if len(records) > limit:
        token = encode_page_token("history", context, items[-1].seq)
    return HistoryPage(name=name, items=items, next_page_token=token)


async def get_outcome(
    pool: Pool, command_id: str, name: str | None = None
) -> CommandOutcome | None:
    async with pool.acquire() as conn:
        return await fetch_outcome(conn, command_id, name)


# ---------------------------------------------------------------------------------------------
# The change feed


async def _writers(conn: Any, among: list[str] | None = None) -> list[str]:
    """Transactions (virtual ids) holding a write lock on this schema's sandboxes table."""
    found = await conn.fetchval(
        "SELECT coalesce(array_agg(DISTINCT virtualtransaction), '{}') FROM pg_locks "
        "WHERE locktype = 'relation' AND relation = to_regclass('sandboxes') "
        "AND mode = 'RowExclusiveLock' AND pid <> pg_backend_pid() "
        "AND ($1::text[] IS NULL OR virtualtransaction = ANY($1::text[]))",
        among,
    )
    return list(found)


async def change_horizon(conn: Any, timeout: float = 2.0) -> int | None:
    """The highest ``change_seq`` below which every change is committed (None: not known yet).

    ``change_seq`` values are drawn from a sequence inside the processor's transactions, so a
    transaction can commit a lower value after another committed a higher one; a watcher that
    moved its cursor past the higher value would miss the lower one forever. A transaction
    draws a value only while it holds a write lock on the table (taken before the statement
    runs), so: read the sequence's last value, then wait until the transactions that held the
    lock at that moment have ended. Every value up to it is then committed (or rolled back)
    and visible to any query that starts afterwards. Writer transactions last milliseconds.
    """
    row = await conn.fetchrow("SELECT last_value, is_called FROM sandbox_changes")
    last = int(row["last_value"]) if row["is_called"] else 0
    writers = await _writers(conn)
    if writers:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.002
        while writers:
            if loop.time() > deadline:
                return None
            await asyncio.sleep(delay)  # a writer's commit does not notify before its lock goes
            delay = min(delay * 2, 0.05)
            writers = await _writers(conn, writers)
    return last


def _setter(event: asyncio.Event) -> Callable[..., None]:
    return lambda *_: event.set()


class ChangeFeed:
    """Wakes watchers when the processor commits (LISTEN), with a slow poll as a safety net."""

    def __init__(self, pool: Pool, poll_interval: float = 1.0) -> None:
        self.pool = pool
        self.poll_interval = poll_interval
        self._changed = asyncio.Event()
        self._closed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # The horizon query in flight, and the mark that was current when it began.
        self._horizon: asyncio.Future[int | None] | None = None
        self._horizon_mark: asyncio.Event | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="change-feed")

    async def close(self) -> None:
        self._closed.set()
        self._changed.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def mark(self) -> asyncio.Event:
        """Take before reading; ``wait(mark)`` then returns on any later change."""
        return self._changed

    async def horizon(self, mark: asyncio.Event) -> int | None:
        """The change horizon (``change_horizon``) as of ``mark`` or later.

        Watchers woken by one change share one query: a query in flight is reused if it began
        while ``mark`` was the current mark, hence after every change notified before it.
        """
        if self._horizon is None or self._horizon.done() or self._horizon_mark is not mark:
            self._horizon_mark = mark
            self._horizon = asyncio.ensure_future(current_horizon(self.pool))
            # Its error reaches the watchers awaiting it; none left is not an unhandled error.
            self._horizon.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(self._horizon)  # one watcher leaving cancels nothing

    async def wait(self, mark: asyncio.Event, timeout: float | None = None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(mark.wait(), timeout or self.poll_interval)

    def _notify(self, *_: object) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _listen(self) -> None:
        delay = 0.5
        while not self._closed.is_set():
            lost = asyncio.Event()
            try:
                async with self.pool.acquire() as conn:
                    conn.add_termination_listener(_setter(lost))
                    await conn.add_listener(CHANGES_CHANNEL, self._notify)
                    delay = 0.5
                    try:
                        while not self._closed.is_set() and not lost.is_set():
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(lost.wait(), timeout=5.0)
                            if conn.is_closed():
                                break
                    finally:
                        if not conn.is_closed():
                            await conn.remove_listener(CHANGES_CHANNEL, self._notify)
            except DATABASE_ERRORS as exc:
                log.warning("change feed: LISTEN failed (%s); polling until it is back", exc)
            self._notify()  # whatever was missed meanwhile: let watchers look
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), timeout=delay)
            delay = min(delay * 2, 10.0)


CHANGES_PAGE: Final = 500  # rows per read of the change feed


_CHANGE_FILTERS: Final = (
    "change_seq > $1 AND change_seq <= $2 AND (NOT $4 OR phase <> 'Deleted') "
    "AND ($6::uuid IS NULL OR sandbox_id = $6) AND ($7::int IS NULL OR generation = $7)"
)
_CHANGES: Final = (
    f"SELECT {_ROW} FROM sandboxes WHERE {_CHANGE_FILTERS} "
    "AND (cardinality($3::text[]) = 0 OR key = ANY($3::text[])) ORDER BY change_seq LIMIT $5"
)
# Named rows are probed by key, one per name: a plan made generic (on empty tables) walked the
# change_seq index from the cursor, i.e. every row changed since, for a stream of one name.
# OFFSET 0 keeps the probe a probe (not flattened into a join the planner may make a scan).
_CHANGES_OF_NAMES: Final = (
    f"SELECT {_ROW} FROM (SELECT DISTINCT name FROM unnest($3::text[]) AS name) AS n "
    "CROSS JOIN LATERAL (SELECT * FROM sandboxes WHERE key = n.name OFFSET 0) AS s "
    f"WHERE {_CHANGE_FILTERS} ORDER BY change_seq LIMIT $5"
)


async def changes_after(
    pool: Pool,
    cursor: int,
    horizon: int,
    *,
    names: Sequence[str] = (),
    live_only: bool = False,
    limit: int = CHANGES_PAGE,
    incarnation: UUID | None = None,
    generation: int | None = None,
) -> list[SandboxView]:
    """Rows changed after ``cursor`` up to ``horizon``, in change order (optionally only one
    incarnation's, or only while at one generation)."""
    records = await pool.fetch(
        _CHANGES_OF_NAMES if names else _CHANGES,
        cursor,
        horizon,
        list(names),
        live_only,
        limit,
        incarnation,
        generation,
    )
    return [sandbox_view(r) for r in records]


async def current_horizon(pool: Pool) -> int | None:
    async with pool.acquire() as conn:
        return await change_horizon(conn)


# ---------------------------------------------------------------------------------------------
# Readiness


async def stored_input_offsets(pool: Pool, topics: Sequence[str]) -> dict[tuple[str, int], int]:
    records = await pool.fetch(
        "SELECT topic, partition, next_offset FROM input_offsets WHERE topic = ANY($1::text[])",
        list(topics),
    )
    return {(r["topic"], r["partition"]): r["next_offset"] for r in records}


async def fetch_outcome(
    conn: Any, command_id: str, key: str | None = None
) -> CommandOutcome | None:
    """The outcome of a command; ``key`` narrows it when a client reused the id across sandboxes."""
    raw = await conn.fetchval(
        "SELECT outcome FROM command_outcomes WHERE command_id = $1 "
        "AND ($2::text IS NULL OR key = $2) ORDER BY decided_at LIMIT 1",
        command_id,
        key,
    )
    return CommandOutcome.model_validate_json(raw) if raw is not None else None


async def await_outcome(
    pool: asyncpg.Pool[asyncpg.Record],
    command_id: str,
    timeout: float = 10.0,
    key: str | None = None,
) -> CommandOutcome | None:
    """Wait until the processor has decided the command; None if the timeout passes first.

    Woken by the processor's per-batch NOTIFY, with a slow poll as a safety net.
    """
    woken = asyncio.Event()

    def _wake(*_: object) -> None:
        woken.set()

    async with pool.acquire() as conn:
        await conn.add_listener(CHANGES_CHANNEL, _wake)
        try:
            deadline = asyncio.get_running_loop().time() + timeout
            while True:
                woken.clear()
                outcome = await fetch_outcome(conn, command_id, key)
                remaining = deadline - asyncio.get_running_loop().time()
                if outcome is not None or remaining <= 0:
                    return outcome
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), timeout=min(remaining, 0.5))
        finally:
            await conn.remove_listener(CHANGES_CHANNEL, _wake)


# ---------------------------------------------------------------------------------------------
# Sandboxes that need an operator's attention (status, metrics)


class Attention(BaseModel):
    as_of: datetime = Field(description="the API's clock when counted")
    past_deadline: int = Field(
        description="live sandboxes whose phase deadline or expiry has passed (not yet acted on)"
    )
    held: int
    expiring_soon: int = Field(description="expiring within expiring_within_seconds")
    expiring_within_seconds: float


async def attention(pool: Pool, now: datetime, soon_seconds: float) -> Attention:
    record = await pool.fetchrow(
        "SELECT count(*) FILTER (WHERE deadline_at <= $1 OR (expires_at <= $1 AND hold IS NULL))"
        " AS past_deadline, count(*) FILTER (WHERE hold IS NOT NULL) AS held, "
        "count(*) FILTER (WHERE expires_at > $1 AND expires_at <= $1 + $2::interval) "
        "AS expiring_soon FROM sandboxes WHERE phase <> 'Deleted'",
        now,
        timedelta(seconds=soon_seconds),
    )
    assert record is not None
    return Attention(
        as_of=now,
        past_deadline=record["past_deadline"],
        held=record["held"],
        expiring_soon=record["expiring_soon"],
        expiring_within_seconds=soon_seconds,
    )
