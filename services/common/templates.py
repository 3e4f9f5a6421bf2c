"""Templates in PostgreSQL: named, versioned sandbox specs, and their resolution into the full
spec of a create.

A template is configuration, like a provider: the API writes it (every write a new revision,
``templates`` pointing at the newest, ``template_revisions`` keeping each one), and a create
or claim naming it is resolved here, at request time, into the full spec the ``CreateSandbox``
command carries with the revision it came from (``TemplateRef``). The log keeps full specs, so
replay never reads this table.

Deleting a template removes its name, not its revisions: a sandbox created from it still names
a revision that existed, and a template created again under the name continues the numbering
(revision n+1), so ``{name, revision}`` always means one spec.

Per-sandbox overrides (``Overrides``) the resolution allows: ``env`` added or replaced,
``labels`` added (a label the template sets cannot be changed: ``OverrideRefused``), the time to
live replaced, providers added. Everything else comes from the template.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, Final

from pydantic import Field, StringConstraints, ValidationError

from events.common import (
    ExitPolicy,
    ExpiryPolicy,
    ProviderName,
    SandboxSpec,
    Strict,
    TemplateRef,
    Text,
    TTLSeconds,
)
from services.common import pools, providers
from services.common.providers import Conn


class TemplateBody(Strict):
    """What a revision holds: the spec and the create's other settings."""

    spec: SandboxSpec
    providers: list[ProviderName] = Field(default_factory=list, max_length=64)
    ttl_seconds: TTLSeconds | None = None
    on_expiry: ExpiryPolicy = "stop"
    on_exit: ExitPolicy = "keep"
    description: Annotated[Text, StringConstraints(max_length=1000)] = ""


@dataclass(frozen=True, slots=True)
class TemplateInfo:
    name: str
    revision: int
    body: TemplateBody
    created_at: datetime  # of the template (its first revision under this name)
    updated_at: datetime  # of this revision
    created_by: str
    updated_by: str


class TemplateMissing(LookupError):
    def __init__(self, name: str, revision: int | None = None) -> None:
        what = f"template {name!r}" + (f" revision {revision}" if revision is not None else "")
        super().__init__(f"{what} not found")
        self.name = name
        self.revision = revision


class TemplateExists(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(f"template {name!r} already exists")


class StaleRevision(Exception):
    """An update or delete based on a revision that is no longer the newest."""

    def __init__(self, name: str, expected: int, current: int) -> None:
        super().__init__(
            f"template {name!r} is at revision {current}, not {expected}: read it again and "
            "retry with expected_revision set to the revision you read"
        )
        self.current = current


class OverrideRefused(ValueError):
    """A per-sandbox override the template does not allow; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"field {field!r}: {message}")
        self.field = field
        self.message = message


_SELECT: Final = """
SELECT t.name, r.revision, r.body, t.created_at, r.created_at AS updated_at, t.created_by,
       r.created_by AS updated_by
FROM templates t JOIN template_revisions r ON r.name = t.name
"""


def _info(r: Any) -> TemplateInfo:
    return TemplateInfo(
        r["name"],
        r["revision"],
        TemplateBody.model_validate_json(r["body"]),
        r["created_at"],
        r["updated_at"],
        r["created_by"],
        r["updated_by"],
    )


# One revision, kept after the template's name was deleted (then "created" is the revision's).
_REVISION: Final = """
SELECT r.name, r.revision, r.body, coalesce(t.created_at, r.created_at) AS created_at,
       r.created_at AS updated_at, coalesce(t.created_by, r.created_by) AS created_by,
       r.created_by AS updated_by
FROM template_revisions r LEFT JOIN templates t ON t.name = r.name
WHERE r.name = $1 AND r.revision = $2
"""


async def get_template(
    conn: Conn, name: str, revision: int | None = None, *, deleted: bool = False
) -> TemplateInfo | None:
    """The newest revision of a live template, or the one named; with ``deleted``, a named
    revision of a deleted template too (None if missing)."""
    if revision is None:
        row = await conn.fetchrow(_SELECT + "WHERE t.name = $1 AND r.revision = t.revision", name)
    elif deleted:
        row = await conn.fetchrow(_REVISION, name, revision)
    else:
        row = await conn.fetchrow(_SELECT + "WHERE t.name = $1 AND r.revision = $2", name, revision)
    return _info(row) if row is not None else None


async def list_templates(
    conn: Conn, *, after: str | None = None, limit: int | None = None
) -> list[TemplateInfo]:
    """Live templates at their newest revisions, by name: those after ``after``, at most
    ``limit`` of them (a page)."""
    rows = await conn.fetch(
        _SELECT + "WHERE r.revision = t.revision AND ($1::text IS NULL OR t.name > $1) "
        "ORDER BY t.name LIMIT $2",
        after,
        limit,
    )
    return [_info(r) for r in rows]


async def naming(conn: Conn, provider: str) -> list[str]:
    """The live templates whose newest revision names ``provider`` (a provider's delete is
    refused while there are any: every create and claim from them would fail)."""
    rows = await conn.fetch(
        "SELECT t.name FROM templates t JOIN template_revisions r "
        "ON r.name = t.name AND r.revision = t.revision "
        "WHERE r.body -> 'providers' ? $1 ORDER BY t.name",
        provider,
    )
    return [r["name"] for r in rows]


async def create_template(
    conn: Conn, name: str, body: TemplateBody, actor: str, at: datetime
) -> TemplateInfo:
    """A new template at the revision after any its name had before (TemplateExists if live;
    ProviderMissing if a provider it names does not exist, checked under ``providers.hold``)."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('template:' || $1))", name)
        if await conn.fetchval("SELECT 1 FROM templates WHERE name = $1", name):
            raise TemplateExists(name)
        await providers.hold(conn, body.providers)
        revision = await conn.fetchval(
            "SELECT coalesce(max(revision), 0) + 1 FROM template_revisions WHERE name = $1", name
        )
        await _add_revision(conn, name, revision, body, actor, at)
        await conn.execute(
            "INSERT INTO templates (name, revision, created_at, updated_at, created_by, "
            "updated_by) VALUES ($1, $2, $3, $3, $4, $4)",
            name,
            revision,
            at,
            actor,
        )
        await pools.notify(conn)  # a pool waiting for its template
    found = await get_template(conn, name)
    assert found is not None
    return found


async def update_template(
    conn: Conn, name: str, body: TemplateBody, expected: int, actor: str, at: datetime
) -> TemplateInfo:
    """The next revision, only if ``expected`` is the newest (StaleRevision otherwise;
    ProviderMissing as for a create)."""
    async with conn.transaction():
        current = await conn.fetchval(
            "SELECT revision FROM templates WHERE name = $1 FOR UPDATE", name
        )
        if current is None:
            raise TemplateMissing(name)
        if current != expected:
            raise StaleRevision(name, expected, current)
        await providers.hold(conn, body.providers)
        await _add_revision(conn, name, current + 1, body, actor, at)
        await conn.execute(
            "UPDATE templates SET revision = $2, updated_at = $3, updated_by = $4 WHERE name = $1",
            name,
            current + 1,
            at,
            actor,
        )
        await pools.notify(conn)  # its pools' members follow the new revision
    found = await get_template(conn, name)
    assert found is not None
    return found


async def delete_template(conn: Conn, name: str, expected: int | None = None) -> int:
    """Remove the name (its revisions stay, see the module's docstring); the revision it was
    at. TemplateMissing, or StaleRevision when ``expected`` is not the newest."""
    async with conn.transaction():
        current = await conn.fetchval(
            "SELECT revision FROM templates WHERE name = $1 FOR UPDATE", name
        )
        if current is None:
            raise TemplateMissing(name)
        if expected is not None and current != expected:
            raise StaleRevision(name, expected, current)
        await conn.execute("DELETE FROM templates WHERE name = $1", name)
        await pools.notify(conn)
    return int(current)


async def _add_revision(
    conn: Conn, name: str, revision: int, body: TemplateBody, actor: str, at: datetime
) -> None:
    await conn.execute(
        "INSERT INTO template_revisions (name, revision, body, created_at, created_by) "
        "VALUES ($1, $2, $3, $4, $5)",
        name,
        revision,
        body.model_dump_json(),
        at,
        actor,
    )


# The revisions of a template that unclaimed members of some pools were made from.
_MEMBER_REVISIONS: Final = """
SELECT r.name, r.revision, r.body, coalesce(t.created_at, r.created_at) AS created_at,
       r.created_at AS updated_at, coalesce(t.created_by, r.created_by) AS created_by,
       r.created_by AS updated_by
FROM template_revisions r LEFT JOIN templates t ON t.name = r.name
WHERE r.name = $1 AND r.revision IN (
    SELECT DISTINCT (s.template->>'revision')::int FROM sandboxes s
    WHERE s.pool = ANY($2::text[]) AND s.template->>'name' = $1 AND s.claim_id IS NULL
      AND s.phase <> 'Deleted')
ORDER BY r.revision
"""


async def member_revisions(conn: Conn, name: str, pools: Sequence[str]) -> list[TemplateInfo]:
    """The revisions of template ``name`` that the unclaimed members of ``pools`` run: what a
    claim of one of them would get (a roll or ``OnReplenish`` keeps older ones serving)."""
    return [_info(r) for r in await conn.fetch(_MEMBER_REVISIONS, name, list(pools))]


async def revision_decided(conn: Conn, key: str, command_id: str, name: str) -> int | None:
    """The revision of template ``name`` a create of ``key`` under ``command_id`` was decided
    with, if it was: a retry of that create resolves to it again (not to a newer revision,
    which would make it another request under the same id)."""
    found = await conn.fetchval(
        "SELECT message->'template'->>'revision' FROM history WHERE key = $1 "
        "AND command_id = $2 AND message_type = 'CreateSandbox' "
        "AND message->'template'->>'name' = $3 ORDER BY id LIMIT 1",
        key,
        command_id,
        name,
    )
    return int(found) if found is not None else None


def named_by(ref: TemplateRef | None, asked: Sequence[str], provider: str) -> str | None:
    """How to say that a missing ``provider`` is the template's, not the request's (``asked``):
    a provider a template names may have been deleted since. None when the request named it."""
    if ref is None or provider in asked:
        return None
    return f"template {ref.name!r} revision {ref.revision} names it"


@dataclass(frozen=True, slots=True)
class Overrides:
    """What one sandbox may change of its template (the module's docstring says the rule)."""

    env: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    ttl_seconds: int | None = None
    providers: Sequence[str] = ()
    # Only OpenShell's door sets it: there a sandbox's command is its own spec's, the
    # template being the workload (image, environment, resources). The HTTP API refuses it.
    command: Sequence[str] | None = None


@dataclass(frozen=True, slots=True)
class Resolved:
    """A template revision with a sandbox's overrides applied: what its CreateSandbox carries."""

    spec: SandboxSpec
    providers: list[str]
    ttl_seconds: int | None
    on_expiry: ExpiryPolicy
    on_exit: ExitPolicy
    ref: TemplateRef | None  # None: a full spec given, no template


async def resolve(
    conn: Conn,
    name: str,
    overrides: Overrides | None = None,
    revision: int | None = None,
    *,
    deleted: bool = False,
) -> Resolved:
    """The full spec of a create from template ``name`` (its newest revision unless
    ``revision``; a deleted template's only with ``deleted``: the retry of a create decided
    before the delete), with ``overrides``. TemplateMissing, OverrideRefused."""
    info = await get_template(conn, name, revision, deleted=deleted)
    if info is None:
        if revision is not None and await get_template(conn, name) is None:
            raise TemplateMissing(name)
        raise TemplateMissing(name, revision)
    return apply(info, overrides or Overrides())


def apply(info: TemplateInfo, overrides: Overrides) -> Resolved:
    """``resolve`` without the read (pure): the overrides checked and applied."""
    base = info.body
    changed = {
        k for k, v in overrides.labels.items() if k in base.spec.labels and base.spec.labels[k] != v
    }
    if changed:
        key = sorted(changed)[0]
        raise OverrideRefused(
            f"overrides.labels.{key}",
            f"template {info.name!r} sets this label to {base.spec.labels[key]!r}; a sandbox "
            "may add labels, not change the template's",
        )
    merged: dict[str, Any] = {
        "env": {**base.spec.env, **overrides.env},
        "labels": {**base.spec.labels, **overrides.labels},
    }
    if overrides.command is not None:
        merged["command"] = list(overrides.command)
    try:
        spec = SandboxSpec.model_validate(base.spec.model_dump() | merged)
    except ValidationError as exc:  # e.g. more variables than a spec holds
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"][:1])
        raise OverrideRefused(f"overrides.{where}", first["msg"]) from None
    return Resolved(
        spec=spec,
        providers=sorted({*base.providers, *overrides.providers}),
        ttl_seconds=overrides.ttl_seconds
        if overrides.ttl_seconds is not None
        else base.ttl_seconds,
        on_expiry=base.on_expiry,
        on_exit=base.on_exit,
        ref=TemplateRef(name=info.name, revision=info.revision),
    )
