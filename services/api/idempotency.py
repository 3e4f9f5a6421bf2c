"""Idempotency keys: what the API remembers of each command it took in.

A ``command_id`` names one request: its type, sandbox, caller and body (the fingerprint: a
sha256 of the command without its id, time and caller). The first request with an id is
recorded before it is published and marked published once Kafka acknowledged it (the marks
of commands acknowledged together in one statement: ``PublishedMarks``); a later one
with the same id and the same fingerprint is a retry (it gets the first outcome), one with
another fingerprint is refused, whatever happened to the sandbox in between (a re-created name
included). ``GET /v1/commands/{id}`` answers 404 for an id that is neither decided nor
published through the API.

Provider writes (services/api/providers.py) share the key: ``claim`` records one in the
write's own transaction, ``keep_outcome`` stores what it answered (a retry gets it back), and it
is never published, so the command ids and the provider write ids are one namespace.

Records are kept ``api_command_retention_hours`` (30 days by default; 0: forever), then
forgotten by every API process's sweep (``keep_forgetting``): a retry after that is a new
request to the API, and a command's is then answered by the processor's own de-duplication
(docs/api.md, "Idempotency", says what that means).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import asyncpg

from events.backoff import pause
from events.commands import Command
from services.common.names import KEY_OF

log = logging.getLogger("sandstream.api")

# The sweep runs at most this far apart, and four times per retention period when that is
# shorter (but never more often than SWEEP_MIN_SECONDS, however short the retention); each
# statement deletes at most a chunk (short transactions, short locks).
SWEEP_MAX_SECONDS: Final = 3600.0
SWEEP_MIN_SECONDS: Final = 0.25
SWEEP_CHUNK: Final = 10_000

Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"
Conn: TypeAlias = Any  # a pool, a connection or a pool connection proxy


class IdempotencyConflict(Exception):
    """The command id was first used for another request."""

    def __init__(self, command_id: str, first: Recorded) -> None:
        super().__init__(
            f"command_id {command_id!r} was first used for a different request "
            f"({first.command_type} of {first.key!r}); an idempotency key names one "
            "request: use a new command_id for a new request"
        )
        self.command_id = command_id


@dataclass(frozen=True, slots=True)
class Recorded:
    key: str
    command_type: str
    actor: str
    fingerprint: str
    published: bool
    outcome: Any = None  # a provider write's answer (JSON), None for a command


def digest(body: Any) -> str:
    """The sha256 of ``body``'s canonical JSON (keys sorted, no spaces)."""
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()


def fingerprint(command: Command) -> str:
    """What makes two requests the same: everything but the id, the time and the caller (the
    caller is compared on its own)."""
    return digest(command.model_dump(mode="json", exclude={"command_id", "occurred_at", "actor"}))


async def recorded(conn: Conn, command_id: str) -> Recorded | None:
    row = await conn.fetchrow(
        "SELECT key, command_type, actor, fingerprint, published, outcome::text AS outcome "
        "FROM api_commands WHERE command_id = $1",
        command_id,
    )
    if row is None:
        return None
    outcome = None if row["outcome"] is None else json.loads(row["outcome"])
    return Recorded(
        row["key"], row["command_type"], row["actor"], row["fingerprint"], row["published"], outcome
    )


async def claim(
    conn: Conn, command_id: str, key: str, command_type: str, actor: str, mine: str
) -> Recorded | None:
    """Record the request with fingerprint ``mine`` under ``command_id``; the earlier record
    if the id was known (a retry), ``IdempotencyConflict`` if that record is of another request.
    In a transaction, a concurrent claim of the same id waits for it to end."""
    while True:
        inserted = await conn.fetchval(
            "INSERT INTO api_commands (command_id, key, command_type, actor, fingerprint) "
            "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (command_id) DO NOTHING RETURNING true",
            command_id,
            key,
            command_type,
            actor,
            mine,
        )
        if inserted:
            return None
        first = await recorded(conn, command_id)
        if first is not None:
            break
        # Forgotten by the retention sweep between the two statements: claim it anew.
    if first.fingerprint != mine or first.actor != actor or first.command_type != command_type:
        raise IdempotencyConflict(command_id, first)
    return first


# Records the command under its id and looks up its outcome on its key. With $6, only when
# the name $2 stands for itself (services.common.names): a name bound to an adopted member is
# recorded nothing here, and its key is returned for the caller to record the command as the
# member's (as before the fold: the record's key and fingerprint are those of the command
# published).
_RECORD_AND_OUTCOME: Final = (
    f"WITH k AS (SELECT CASE WHEN $6 THEN {KEY_OF.format('$2::text')} ELSE $2 END AS key), "
    "mine AS (INSERT INTO api_commands (command_id, key, command_type, actor, fingerprint) "
    "SELECT $1, $2, $3, $4, $5 WHERE (SELECT key FROM k) = $2 "
    "ON CONFLICT (command_id) DO NOTHING RETURNING true AS inserted) "
    "SELECT (SELECT key FROM k) AS key, (SELECT inserted FROM mine) AS inserted, "
    "(SELECT outcome FROM command_outcomes WHERE command_id = $1 AND key = $2 "
    "ORDER BY decided_at LIMIT 1) AS outcome"
)


@dataclass(frozen=True, slots=True)
class Recording:
    """What ``record_and_outcome`` found: the command as recorded (keyed by the sandbox its
    name stands for), its first recording when the id was known, its outcome's JSON if any."""

    command: Command
    first: Recorded | None
    outcome: str | None


async def record_and_outcome(conn: Conn, command: Command, *, resolve: bool) -> Recording:
    """Record ``command`` under its id (``claim``), and find its outcome (its JSON) if one was
    decided on its key: one round trip for a command whose id is new (a known id takes
    ``claim``'s reads after). ``resolve``: key it by the sandbox its name stands for first, in
    the same round trip unless the name is bound to a member (then one more)."""
    mine = fingerprint(command)
    row = await conn.fetchrow(
        _RECORD_AND_OUTCOME,
        command.command_id,
        command.key,
        command.type,
        command.actor,
        mine,
        resolve,
    )
    if row["key"] != command.key:  # bound: recorded as the member's
        member = command.model_copy(update={"key": row["key"]})
        return await record_and_outcome(conn, member, resolve=False)
    if row["inserted"]:
        return Recording(command, None, row["outcome"])
    first = await claim(conn, command.command_id, command.key, command.type, command.actor, mine)
    return Recording(command, first, row["outcome"])


async def keep_outcome(conn: Conn, command_id: str, outcome: Any) -> None:
    """Store what a provider write answered, for its retries (in the write's transaction)."""
    await conn.execute(
        "UPDATE api_commands SET outcome = $2::jsonb WHERE command_id = $1",
        command_id,
        json.dumps(outcome, sort_keys=True),
    )


async def mark_published(conn: Conn, command_ids: str | list[str]) -> None:
    """Mark the command (or each of the commands) published."""
    ids = [command_ids] if isinstance(command_ids, str) else command_ids
    await conn.execute(
        "UPDATE api_commands SET published = true "
        "WHERE command_id = ANY($1::text[]) AND NOT published",
        ids,
    )


class PublishedMarks:
    """Marks commands published once Kafka acknowledged them, one statement for all the
    commands waiting at once: under load, a create's third statement (and its pool
    acquisition) is shared by every create acknowledged while the previous one ran. ``mark``
    returns once its command's mark is committed (or raises what the statement raised)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._waiting: dict[str, list[asyncio.Future[None]]] = {}
        self._marking: asyncio.Task[None] | None = None

    async def mark(self, command_id: str) -> None:
        done = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(command_id, []).append(done)
        if self._marking is None:
            self._marking = asyncio.create_task(self._mark_waiting(), name="published marks")
        await done

    async def _mark_waiting(self) -> None:
        batch: dict[str, list[asyncio.Future[None]]] = {}
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, {}
                try:
                    await mark_published(self.pool, list(batch))
                except Exception as exc:
                    _settle(batch, exc)
                else:
                    _settle(batch, None)
                batch = {}
        finally:
            self._marking = None
            for left in (batch, self._waiting):  # cancelled itself (the loop's end)
                for futures in left.values():
                    for done in futures:
                        done.cancel()


def _settle(batch: dict[str, list[asyncio.Future[None]]], exc: Exception | None) -> None:
    for futures in batch.values():
        for done in futures:
            if done.done():  # its request went away
                continue
            if exc is None:
                done.set_result(None)
            else:
                done.set_exception(exc)


async def forget_expired(pool: Pool, retention_hours: float) -> int:
    """Delete the records first used more than ``retention_hours`` ago (by the database's
    clock, which stamped them), a chunk per statement; returns how many."""
    total = 0
    while True:
        gone: int = await pool.fetchval(
            "WITH gone AS (DELETE FROM api_commands WHERE command_id IN ("
            "SELECT command_id FROM api_commands "
            "WHERE recorded_at < now() - make_interval(secs => $1) ORDER BY recorded_at "
            "LIMIT $2) RETURNING 1) "
            "SELECT count(*) FROM gone",
            retention_hours * 3600,
            SWEEP_CHUNK,
        )
        total += gone
        if gone < SWEEP_CHUNK:
            return total


def sweep_seconds(retention_hours: float) -> float:
    return max(SWEEP_MIN_SECONDS, min(SWEEP_MAX_SECONDS, retention_hours * 3600 / 4))


async def keep_forgetting(pool: Pool, retention_hours: float, stop: asyncio.Event) -> None:
    """Until ``stop``: forget the expired records now, then every ``sweep_seconds``. Never
    ends on an error (logged; tried again next time). Nothing with a retention of 0."""
    if retention_hours <= 0:
        return
    while True:
        try:
            if forgotten := await forget_expired(pool, retention_hours):
                log.info("forgot %d command ids first used over %g hours ago",
                         forgotten, retention_hours)  # fmt: skip
        except Exception as exc:  # the sweep outlives any one failure
            log.warning("forgetting expired command ids failed (will retry): %r", exc)
        if await pause(stop, sweep_seconds(retention_hours)):
            return
