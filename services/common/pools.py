"""Warm pools in PostgreSQL: the pool table (written by the API, read by the pool controller),
the controller's record of the creates it asked for, and the claims served from a pool's
template (written by the API, read by the pool's status).

A pool is configuration, as a provider or a template is: its members are ordinary sandboxes
decided on the log (``CreateSandbox`` with ``pool`` set), so nothing here is replayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal, TypeAlias, get_args

import orjson

from events.topics import POOLS_CHANNEL

Conn: TypeAlias = Any  # an asyncpg connection or pool connection proxy
Strategy = Literal["Recreate", "OnReplenish"]
STRATEGIES: Final[tuple[Strategy, ...]] = get_args(Strategy)
# A member's key is `<pool>-<8 random [a-z0-9]>` and must be a sandbox name (at most 63).
MEMBER_SUFFIX_LENGTH: Final = 8
POOL_NAME_PATTERN: Final = r"^[a-z0-9]([a-z0-9-]{0,52}[a-z0-9])?$"  # at most 54 characters
POOL_SIZE_MAX: Final = 1000
# The claims a pool's latency figures are taken over (the newest of each path).
LATENCY_WINDOW: Final = 1000


@dataclass(frozen=True, slots=True)
class PoolInfo:
    name: str
    template: str
    size: int
    strategy: Strategy
    revision: int
    created_at: datetime
    updated_at: datetime
    created_by: str
    updated_by: str
    problem: str | None  # why the controller cannot fill it now (None: nothing in the way)


class PoolMissing(LookupError):
    def __init__(self, name: str) -> None:
        super().__init__(f"pool {name!r} not found")


class PoolExists(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"pool {name!r} already exists")


class RevisionMismatch(Exception):
    def __init__(self, name: str, expected: int, current: int) -> None:
        super().__init__(
            f"pool {name!r} is at revision {current}, not {expected} (read it again and retry)"
        )
        self.current = current


_COLUMNS = (
    "name, template, size, strategy, revision, created_at, updated_at, created_by, updated_by, "
    "problem"
)


def _info(r: Any) -> PoolInfo:
    return PoolInfo(**{k: r[k] for k in _COLUMNS.split(", ")})


async def notify(conn: Conn) -> None:
    await conn.execute("SELECT pg_notify(notify_channel($1), '')", POOLS_CHANNEL)


async def set_problems(conn: Conn, problems: dict[str, str | None]) -> None:
    """The controller's word on each pool (a column of its own: no revision, no notify)."""
    await conn.execute(
        "UPDATE pools p SET problem = u.problem FROM unnest($1::text[], $2::text[]) "
        "AS u(name, problem) WHERE p.name = u.name AND p.problem IS DISTINCT FROM u.problem",
        list(problems), list(problems.values()),
    )  # fmt: skip


async def list_pools(conn: Conn) -> list[PoolInfo]:
    return [_info(r) for r in await conn.fetch(f"SELECT {_COLUMNS} FROM pools ORDER BY name")]


async def get_pool(conn: Conn, name: str) -> PoolInfo | None:
    r = await conn.fetchrow(f"SELECT {_COLUMNS} FROM pools WHERE name = $1", name)
    return None if r is None else _info(r)


async def pools_of_template(conn: Conn, template: str) -> list[PoolInfo]:
    rows = await conn.fetch(
        f"SELECT {_COLUMNS} FROM pools WHERE template = $1 ORDER BY name", template
    )
    return [_info(r) for r in rows]


async def create_pool(
    conn: Conn, name: str, template: str, size: int, strategy: Strategy, actor: str, now: datetime
) -> PoolInfo:
    r = await conn.fetchrow(
        f"INSERT INTO pools ({_COLUMNS}) VALUES ($1, $2, $3, $4, 1, $5, $5, $6, $6, NULL) "
        f"ON CONFLICT (name) DO NOTHING RETURNING {_COLUMNS}",
        name, template, size, strategy, now, actor,
    )  # fmt: skip
    if r is None:
        raise PoolExists(name)
    await notify(conn)
    return _info(r)


async def update_pool(
    conn: Conn,
    name: str,
    *,
    expected_revision: int | None,
    actor: str,
    now: datetime,
    size: int | None = None,
    strategy: Strategy | None = None,
    template: str | None = None,
) -> PoolInfo:
    """Change what is given; the revision goes up by one. ``expected_revision`` (when given)
    must be the current one: two writers cannot both believe they set the pool."""
    async with conn.transaction():
        current = await _locked(conn, name, expected_revision)
        r = await conn.fetchrow(
            f"UPDATE pools SET size = $2, strategy = $3, template = $4, revision = revision + 1, "
            f"updated_at = $5, updated_by = $6 WHERE name = $1 RETURNING {_COLUMNS}",
            name,
            current.size if size is None else size,
            current.strategy if strategy is None else strategy,
            current.template if template is None else template,
            now,
            actor,
        )
        await notify(conn)
    return _info(r)


async def delete_pool(conn: Conn, name: str, expected_revision: int | None) -> PoolInfo:
    """Remove the pool; the controller then deletes its unclaimed members (claimed ones stay)."""
    async with conn.transaction():
        current = await _locked(conn, name, expected_revision)
        await conn.execute("DELETE FROM pools WHERE name = $1", name)
        await forget_claims(conn, name)
        await notify(conn)
    return current


async def _locked(conn: Conn, name: str, expected_revision: int | None) -> PoolInfo:
    r = await conn.fetchrow(f"SELECT {_COLUMNS} FROM pools WHERE name = $1 FOR UPDATE", name)
    if r is None:
        raise PoolMissing(name)
    info = _info(r)
    if expected_revision is not None and expected_revision != info.revision:
        raise RevisionMismatch(name, expected_revision, info.revision)
    return info


# --- claims served from a pool's template ---------------------------------------------------


_RECORD = """
WITH claimed AS (
    INSERT INTO pool_claims (pool, claim_id, claimant, warm, reason, seconds)
    VALUES ($1, $6, $2, $3, $4, $5)
    ON CONFLICT (pool, claim_id) DO NOTHING
    RETURNING id
), counted AS (
    INSERT INTO pool_claim_counts (pool, warm, count) SELECT $1, $3, 1 FROM claimed
    ON CONFLICT (pool, warm) DO UPDATE SET count = pool_claim_counts.count + 1
)
SELECT id FROM claimed
"""
# The newest LATENCY_WINDOW claims of a path stay; older ones go, every PRUNE_EVERY claims.
_PRUNE = """
DELETE FROM pool_claims WHERE pool = $1 AND warm = $2 AND id < (
    SELECT id FROM pool_claims WHERE pool = $1 AND warm = $2 ORDER BY id DESC OFFSET $3 LIMIT 1)
"""
PRUNE_EVERY: Final = 100


async def record_claim(
    conn: Conn, pool: str, claim_id: str, claimant: str, warm: bool, reason: str, seconds: float
) -> bool:
    """Count a claim and keep it for the latency figures (pruning the oldest now and then);
    False for a claim id counted already (a retried request)."""
    row_id = await conn.fetchval(_RECORD, pool, claimant, warm, reason, seconds, claim_id)
    if row_id is not None and row_id % PRUNE_EVERY == 0:
        await conn.execute(_PRUNE, pool, warm, LATENCY_WINDOW - 1)
    return row_id is not None


@dataclass(frozen=True, slots=True)
class PathStats:
    """The claims of one path (warm or cold): how many, and their latency in seconds over the
    newest LATENCY_WINDOW of them (None without any)."""

    count: int
    p50: float | None
    p90: float | None
    p99: float | None


_CLAIMS = "SELECT warm, count FROM pool_claim_counts WHERE pool = $1"
_LATENCY = """
SELECT percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY seconds) AS q
FROM (SELECT seconds FROM pool_claims WHERE pool = $1 AND warm = $2
      ORDER BY id DESC LIMIT $3) AS newest
"""


async def claim_stats(conn: Conn, pool: str) -> dict[bool, PathStats]:
    """Claims by path (True: warm) since the pool was created."""
    counts = {r["warm"]: r["count"] for r in await conn.fetch(_CLAIMS, pool)}
    out = {}
    for warm in (True, False):
        q = await conn.fetchval(_LATENCY, pool, warm, LATENCY_WINDOW)
        p50, p90, p99 = q if q is not None else (None, None, None)
        out[warm] = PathStats(counts.get(warm, 0), p50, p90, p99)
    return out


async def forget_claims(conn: Conn, pool: str) -> None:
    """A deleted pool's claim figures go with it (a new pool of the name starts from zero)."""
    await conn.execute("DELETE FROM pool_claims WHERE pool = $1", pool)
    await conn.execute("DELETE FROM pool_claim_counts WHERE pool = $1", pool)


# --- members ---------------------------------------------------------------------------------

# A pool's live members: its sandboxes not yet claimed (adopted ones have left the pool).
_MEMBERS = """
SELECT key, pool, phase, version, template, reason, hold IS NOT NULL AS held
FROM sandboxes
WHERE pool = ANY($1::text[]) AND phase <> 'Deleted' AND adopted_as IS NULL
ORDER BY key
"""
_ALL_MEMBERS = """
SELECT key, pool, phase, version, template, reason, hold IS NOT NULL AS held
FROM sandboxes
WHERE pool IS NOT NULL AND phase <> 'Deleted' AND adopted_as IS NULL
ORDER BY key
"""


@dataclass(frozen=True, slots=True)
class Member:
    key: str
    pool: str
    phase: str
    version: int
    template: str | None  # the template (name, revision) it was created from
    template_revision: int | None
    reason: str | None
    held: bool = False  # an operator's hold: no claim takes it, the controller leaves it be


def _member(r: Any) -> Member:
    ref = r["template"]
    ref = orjson.loads(ref) if isinstance(ref, str | bytes) else (ref or {})
    revision = ref.get("revision")
    return Member(
        r["key"], r["pool"], r["phase"], r["version"], ref.get("name"),
        int(revision) if revision is not None else None, r["reason"], bool(r["held"]),
    )  # fmt: skip


async def members(conn: Conn, pools: list[str] | None = None) -> list[Member]:
    """The unclaimed live members of the pools named (of every pool named by a row: None)."""
    if pools is None:
        return [_member(r) for r in await conn.fetch(_ALL_MEMBERS)]
    return [_member(r) for r in await conn.fetch(_MEMBERS, pools)]


async def claimed_count(conn: Conn, pool: str) -> int:
    """Live sandboxes adopted out of ``pool`` (they are the claimants' now)."""
    value: int = await conn.fetchval(
        "SELECT count(*) FROM sandboxes WHERE pool = $1 AND phase <> 'Deleted' "
        "AND adopted_as IS NOT NULL",
        pool,
    )
    return value


async def template_revisions(conn: Conn, names: list[str]) -> dict[str, int]:
    """The current revision of each template named (missing ones are left out)."""
    rows = await conn.fetch(
        "SELECT name, revision FROM templates WHERE name = ANY($1::text[])", names
    )
    return {r["name"]: r["revision"] for r in rows}


# --- the controller's requested creates ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    key: str
    pool: str
    command_id: str
    command: str  # the command's JSON, as published
    folded: bool  # the fold made a row of it (or decided it: see ``refusal``)
    refusal: str | None  # the processor's refusal, if it refused the create


_REQUESTS = """
SELECT r.key, r.pool, r.command_id, r.command::text AS command,
       (s.key IS NOT NULL OR o.status IS NOT NULL) AS folded,
       CASE WHEN o.status = 'rejected' THEN o.code || ': ' || o.message END AS refusal
FROM pool_requests r
LEFT JOIN sandboxes s ON s.key = r.key
LEFT JOIN command_outcomes o ON o.key = r.key AND o.command_id = r.command_id
ORDER BY r.requested_at, r.key
"""


async def requests(conn: Conn) -> list[Request]:
    return [
        Request(r["key"], r["pool"], r["command_id"], r["command"], r["folded"], r["refusal"])
        for r in await conn.fetch(_REQUESTS)
    ]


async def add_requests(
    conn: Conn, requests: list[tuple[str, str, str, str]], now: datetime
) -> None:
    """Record creates (key, pool, command id, command JSON) asked for at ``now``, in one
    round trip."""
    await conn.executemany(
        "INSERT INTO pool_requests (key, pool, command_id, command, requested_at) "
        "VALUES ($1, $2, $3, $4::jsonb, $5)",
        [(*r, now) for r in requests],
    )


async def drop_requests(conn: Conn, keys: list[str]) -> None:
    await conn.execute("DELETE FROM pool_requests WHERE key = ANY($1::text[])", keys)


async def pending_count(conn: Conn, pool: str) -> int:
    value: int = await conn.fetchval(
        "SELECT count(*) FROM pool_requests r WHERE r.pool = $1 "
        "AND NOT EXISTS (SELECT 1 FROM sandboxes s WHERE s.key = r.key)",
        pool,
    )
    return value


# --- what a controller round reads --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolsView:
    """What a pool controller round plans from, read at one moment."""

    pools: list[PoolInfo]
    requests: list[Request]
    members: list[Member]
    revisions: dict[str, int]  # template name -> current revision


async def read_view(conn: Conn) -> PoolsView:
    """The pools, the creates asked for, the members and the templates' revisions, in one
    snapshot. Read one statement after another outside it, a member's row committed between
    the requests and the members counted its create twice: unfolded, and a member (a suite
    run: 40 members made for a pool of 20, the surplus deleted and made again)."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        pools = await list_pools(conn)
        asked = await requests(conn)
        found = await members(conn)
        revisions = await template_revisions(conn, sorted({p.template for p in pools}))
    return PoolsView(pools, asked, found, revisions)
