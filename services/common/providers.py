"""Providers in PostgreSQL: names, types, revisions, encrypted values and their fingerprints.

Nothing here returns a value except ``launch_environment``, which the executor calls for the
launch of a generation, and ``claim_values``, which the API calls for an exec in a sandbox a
claim attached providers to: the values are read (and decrypted) then, never from the log.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeAlias
from uuid import UUID, uuid4

import asyncpg

from projections.credentials import ProviderChange, classify
from projections.lifecycle import Sandbox
from projections.store import SANDBOX_COLUMNS, sandbox_from_record
from services.common.credentials import Sealed, Vault

# Variables sandstream sets itself (SANDSTREAM_IDENTITY): a provider cannot override them.
RESERVED_PREFIX = "SANDSTREAM_"

Conn: TypeAlias = Any  # an asyncpg connection or pool connection proxy
Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"
SALT_BYTES = 32


async def vault(pool: Pool, key: bytes) -> Vault:
    """The vault of this installation: its key and its salt (made on first use)."""
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO credential_salt (salt) VALUES ($1) ON CONFLICT DO NOTHING",
            secrets.token_bytes(SALT_BYTES),
        )
        salt = await conn.fetchval("SELECT salt FROM credential_salt")
    return Vault(key, bytes(salt))


@dataclass(frozen=True, slots=True)
class KeyInfo:
    name: str
    fingerprint: str
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class ProviderInfo:
    name: str
    type: str
    revision: int
    created_at: datetime
    updated_at: datetime
    keys: list[KeyInfo]
    incarnation: UUID  # this provider's, not an earlier one's of the same name

    def fingerprints(self) -> dict[str, str]:
        return {k.name: k.fingerprint for k in self.keys}


_SELECT = """
SELECT p.name, p.type, p.revision, p.created_at, p.updated_at, p.incarnation,
       coalesce(array_agg(c.key ORDER BY c.key) FILTER (WHERE c.key IS NOT NULL), '{}') AS keys,
       coalesce(array_agg(c.fingerprint ORDER BY c.key) FILTER (WHERE c.key IS NOT NULL), '{}')
           AS fingerprints,
       coalesce(array_agg(c.updated_at ORDER BY c.key) FILTER (WHERE c.key IS NOT NULL), '{}')
           AS key_times
FROM providers p LEFT JOIN provider_credentials c ON c.provider = p.name
"""


def _info(r: Any) -> ProviderInfo:
    keys = [
        KeyInfo(k, f, t)
        for k, f, t in zip(r["keys"], r["fingerprints"], r["key_times"], strict=True)
    ]
    return ProviderInfo(
        r["name"],
        r["type"],
        r["revision"],
        r["created_at"],
        r["updated_at"],
        keys,
        r["incarnation"],
    )


async def list_providers(
    conn: Conn,
    names: Iterable[str] | None = None,
    *,
    after: str | None = None,
    limit: int | None = None,
) -> list[ProviderInfo]:
    """The providers named (or all), by name: those after ``after``, at most ``limit`` (a
    page; both apply to all only)."""
    if names is None:
        rows = await conn.fetch(
            _SELECT + " WHERE ($1::text IS NULL OR p.name > $1) "
            "GROUP BY p.name ORDER BY p.name LIMIT $2",
            after,
            limit,
        )
    else:
        rows = await conn.fetch(
            _SELECT + " WHERE p.name = ANY($1::text[]) GROUP BY p.name ORDER BY p.name",
            list(names),
        )
    return [_info(r) for r in rows]


async def get_provider(conn: Conn, name: str) -> ProviderInfo | None:
    found = await list_providers(conn, [name])
    return found[0] if found else None


@dataclass(frozen=True, slots=True)
class Update:
    """The desired values of one provider (all of its keys: keys left out are removed, except
    those in ``keep``, whose stored values stay as they are)."""

    name: str
    values: Mapping[str, str]
    type: str | None = None  # when creating; None keeps the existing type
    # Keys whose value could not be read (the sync controller): a stored value stays.
    keep: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Applied:
    change: ProviderChange
    revision: int
    created: bool
    incarnation: UUID  # this provider's, not an earlier one's of the same name


class ProviderMissing(LookupError):
    def __init__(self, name: str) -> None:
        super().__init__(f"provider {name!r} not found")
        self.name = name


class CredentialMissing(LookupError):
    def __init__(self, name: str, key: str) -> None:
        super().__init__(f"provider {name!r} has no credential {key!r}")


class ProviderExists(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"provider {name!r} already exists")
        self.name = name


async def apply_updates(
    conn: Conn,
    vault: Vault,
    updates: Iterable[Update],
    now: datetime,
    *,
    create: bool | None = None,
) -> list[Applied]:
    """Store the desired values of several providers in one transaction.

    ``create``: True only creates (ProviderExists if one exists), False only updates
    (ProviderMissing if one does not), None does either (the sync controller).
    """
    wanted = sorted(updates, key=lambda u: u.name)
    results = []
    async with conn.transaction():
        for update in wanted:
            row = await conn.fetchrow(
                "SELECT type, revision, incarnation FROM providers WHERE name = $1 FOR UPDATE",
                update.name,
            )
            if row is not None and create is True:
                raise ProviderExists(update.name)
            if row is None and create is False:
                raise ProviderMissing(update.name)
            applied: dict[str, str] = {}
            if row is not None:
                applied = {
                    r["key"]: r["fingerprint"]
                    for r in await conn.fetch(
                        "SELECT key, fingerprint FROM provider_credentials WHERE provider = $1",
                        update.name,
                    )
                }
            desired = {k: vault.fingerprint(update.name, k, v) for k, v in update.values.items()}
            desired |= {k: applied[k] for k in update.keep if k in applied and k not in desired}
            change = classify(update.name, applied, desired)
            revision = row["revision"] if row is not None else 0
            incarnation = row["incarnation"] if row is not None else uuid4()
            if row is None:  # after the revisions of the name's earlier incarnations
                revision = 1 + await _revision_floor(conn, update.name)
                await conn.execute(
                    "INSERT INTO providers (name, type, revision, created_at, updated_at, "
                    "incarnation) VALUES ($1, $2, $5, $3, $3, $4)",
                    update.name,
                    update.type or "generic",
                    now,
                    incarnation,
                    revision,
                )
            elif change.changed:
                revision += 1
                await conn.execute(
                    "UPDATE providers SET revision = $2, updated_at = $3 WHERE name = $1",
                    update.name,
                    revision,
                    now,
                )
            for key in change.of("removed"):
                await conn.execute(
                    "DELETE FROM provider_credentials WHERE provider = $1 AND key = $2",
                    update.name,
                    key,
                )
            for key in change.of("baseline") + change.of("rotated"):
                sealed = vault.seal(update.name, key, update.values[key])
                await conn.execute(
                    """INSERT INTO provider_credentials
                       (provider, key, nonce, ciphertext, fingerprint, updated_at)
                       VALUES ($1, $2, $3, $4, $5, $6)
                       ON CONFLICT (provider, key) DO UPDATE SET nonce = $3, ciphertext = $4,
                           fingerprint = $5, updated_at = $6""",
                    update.name,
                    key,
                    sealed.nonce,
                    sealed.ciphertext,
                    desired[key],
                    now,
                )
            results.append(Applied(change, revision, row is None, incarnation))
    return results


async def reapply(conn: Conn, name: str, key: str, now: datetime) -> Applied:
    """A rotation of ``key`` to its stored value (a static credential's rotation): the next
    revision, so that every attached sandbox restarts on it as after a new value."""
    row = await conn.fetchrow(
        "UPDATE providers SET revision = revision + 1, updated_at = $2 WHERE name = $1 "
        "RETURNING revision, incarnation",
        name,
        now,
    )
    if row is None:
        raise ProviderMissing(name)
    touched = await conn.execute(
        "UPDATE provider_credentials SET updated_at = $3 WHERE provider = $1 AND key = $2",
        name,
        key,
        now,
    )
    if touched == "UPDATE 0":
        raise CredentialMissing(name, key)
    change = ProviderChange(name, {key: "rotated"})
    return Applied(change, row["revision"], False, row["incarnation"])


async def delete_provider(conn: Conn, name: str) -> bool:
    """Delete it, remembering its last revision: one created again under the name goes on
    from there, so revisions compare across incarnations (migration 0139)."""
    last = await conn.fetchval("DELETE FROM providers WHERE name = $1 RETURNING revision", name)
    if last is None:
        return False
    await conn.execute(
        "INSERT INTO provider_revision_floors (name, revision) VALUES ($1, $2) "
        "ON CONFLICT (name) DO UPDATE "
        "SET revision = greatest(provider_revision_floors.revision, EXCLUDED.revision)",
        name,
        last,
    )
    return True


async def hold(conn: Conn, names: Iterable[str]) -> None:
    """Lock providers ``names`` against a delete until the caller's transaction ends;
    ProviderMissing for the first that does not exist (or was deleted while this waited). A
    template naming them is written under this lock: a delete either sees the template and is
    refused, or ends first and the template's write is refused (docs/pools.md)."""
    wanted = sorted(set(names))
    if not wanted:
        return
    found = {
        r["name"]
        for r in await conn.fetch(
            "SELECT name FROM providers WHERE name = ANY($1::text[]) ORDER BY name FOR KEY SHARE",
            wanted,
        )
    }
    for name in wanted:
        if name not in found:
            raise ProviderMissing(name)


async def _revision_floor(conn: Conn, name: str) -> int:
    floor = await conn.fetchval(
        "SELECT revision FROM provider_revision_floors WHERE name = $1", name
    )
    return int(floor or 0)


async def attached_sandboxes(conn: Conn, providers: Iterable[str]) -> list[Sandbox]:
    """The live sandboxes that have any of ``providers`` attached."""
    rows = await conn.fetch(
        f"SELECT {SANDBOX_COLUMNS} FROM sandboxes "
        "WHERE phase <> 'Deleted' AND providers && $1::text[] ORDER BY key",
        list(providers),
    )
    return [sandbox_from_record(r) for r in rows]


@dataclass(frozen=True, slots=True)
class LaunchValues:
    """What a launch reads: the environment (values: never in a repr) and, for each attached
    provider, the revision those values are of (0: no such provider)."""

    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    revisions: Mapping[str, int] = field(default_factory=dict)


async def launch_environment(conn: Conn, vault: Vault, key: str) -> LaunchValues:
    """The decrypted values of the providers attached to sandbox ``key`` now, as environment
    variables, with their revisions (one snapshot, so they agree). Providers are merged in name
    order (a later provider's key wins); an attached name with no provider behind it
    contributes nothing."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        attached = await conn.fetch(
            """SELECT a.name, coalesce(p.revision, 0) AS revision
               FROM sandboxes s CROSS JOIN unnest(s.providers) AS a(name)
               LEFT JOIN providers p ON p.name = a.name WHERE s.key = $1""",
            key,
        )
        rows = await conn.fetch(
            """SELECT c.provider, c.key, c.nonce, c.ciphertext
               FROM sandboxes s JOIN provider_credentials c ON c.provider = ANY(s.providers)
               WHERE s.key = $1 ORDER BY c.provider, c.key""",
            key,
        )
    env = {
        r["key"]: vault.open(r["provider"], r["key"], Sealed(r["nonce"], r["ciphertext"]))
        for r in rows
    }
    return LaunchValues(env, {r["name"]: r["revision"] for r in attached})


async def claim_values(conn: Conn, vault: Vault, key: str) -> dict[str, str]:
    """The decrypted values of the providers a claim attached to sandbox ``key`` and still
    attached, as environment variables (merged as a launch merges them: in name order), for an
    exec (services/common/exec_env.py). A name with no provider behind it contributes nothing."""
    rows = await conn.fetch(
        """SELECT c.provider, c.key, c.nonce, c.ciphertext
           FROM sandboxes s JOIN provider_credentials c
             ON c.provider = ANY(s.claim_providers) AND c.provider = ANY(s.providers)
           WHERE s.key = $1 ORDER BY c.provider, c.key""",
        key,
    )
    return {
        r["key"]: vault.open(r["provider"], r["key"], Sealed(r["nonce"], r["ciphertext"]))
        for r in rows
    }
