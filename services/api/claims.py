"""A claim: a warm pool's Ready member adopted under the claimant's name (docs/adr/0009).

The API picks (the imperative shell): it reads the pool's Ready members no claim adopted yet
from PostgreSQL, sends ``AdoptSandbox`` to one, and on a refusal (adopted by another claim
meanwhile, no longer Ready, held) tries the next, reading again once its list is used up. Only
a read that finds none left ends the claim cold (``warm`` false): the caller then creates the
claimant's name from the template. The member's key decides the adoption (never twice); the
name's key decides the name (``BindSandboxName``, sent by the processor): a claim is warm once
its name is bound to the member it adopted.

Per-claim labels, env, providers and time to live ride on the adoption (the member's row
takes them, without a restart). The env and the providers' values reach every exec through
sandstream's doors (services/common/exec_env.py), not the member's running process, which
keeps the template's environment; only a door whose driver can pass an exec's environment
privately may claim so warm (``env_refusal``: why not, and the claim is cold).

Concurrent claims in one API process never ask for the same member: a claim skips the members
this process has an adoption in flight for, and when only such members are left it waits for
one of those adoptions to be decided and reads again (so N claims at once against M Ready
members send min(N, M) adoptions here; claims in other processes may still collide, and the
member's fold refuses all but one).

The claim id makes a claim idempotent: a claim retried with its id (an API process killed
mid-claim, a client's retry) finds its name bound, or the member it adopted, and waits for
that instead of adopting another.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final
from uuid import UUID
from weakref import WeakKeyDictionary

from events.commands import AdoptSandbox
from events.outcomes import Code
from events.publisher import now
from projections.uuids import uuid5
from services.api.gateway import CommandGateway

# Candidates read at once; a claim tries them in a random order, so concurrent claims spread
# over the pool's members instead of all asking for the oldest one.
CANDIDATES: Final = 32
ADOPT_NS: Final = UUID("8a4f0c2e-1b3d-4e5f-a6b7-c8d9e0f1a2b3")

# The pool's Ready members no claim adopted yet (sandboxes_pool_ready), made from the template
# the claim names, of a revision the claim may have (an OnReplenish pool, or a Recreate roll,
# serves older ones; a pool pointed at another template keeps the old one's members a while).
_READY: Final = (
    "SELECT key FROM sandboxes WHERE pool = {pool} AND claim_id IS NULL AND phase = 'Ready' "
    "AND hold IS NULL AND ({template}::text IS NULL OR (template->>'name' = {template} "
    "AND (template->>'revision')::int = ANY({revisions}::int[]))) "
    "ORDER BY updated_at LIMIT {limit}"
)
_CANDIDATES: Final = _READY.format(pool="$1", limit="$2", template="$3", revisions="$4")
# What a claim first finds, in one round trip: the name's row, the member it adopted before (a
# retried claim) and the candidates.
_FIRST: Final = f"""
SELECT n.phase, n.bound_to, n.claim_id,
       (SELECT key FROM sandboxes WHERE pool = $2 AND claim_id = $3
        ORDER BY updated_at LIMIT 1) AS adopted,
       ARRAY({_READY.format(pool="$2", limit="$4", template="$5", revisions="$6")}) AS candidates
FROM (SELECT) AS one LEFT JOIN sandboxes n ON n.key = $1
"""
# The name's row and whether ``member`` is still adopted by the claim (None: gone or another's).
_BINDING: Final = """
SELECT n.bound_to, n.claim_id,
       (SELECT adopted_as IS NULL FROM sandboxes WHERE key = $2 AND claim_id = $3) AS abandoned
FROM (SELECT) AS one LEFT JOIN sandboxes n ON n.key = $1
"""
# Per API process (its gateway): the members an adoption is in flight for, each with an event
# set once it is decided.
_ADOPTING: WeakKeyDictionary[CommandGateway, dict[str, asyncio.Event]] = WeakKeyDictionary()


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """A claim's outcome: ``warm`` with the adopted ``member`` (the claimant's name is bound to
    it), or cold (``member`` None) and why: the caller then creates the name itself."""

    warm: bool
    member: str | None
    reason: str
    attempts: int = 0  # adoptions sent


def adopt_command_id(claim_id: str, member: str) -> str:
    """The adoption's command id: one per (claim, member), so a retried claim's adoption of a
    member is the same command (its first outcome stands)."""
    return str(uuid5(ADOPT_NS, f"{claim_id}/{member}"))


def cold(reason: str, attempts: int = 0) -> ClaimResult:
    return ClaimResult(False, None, reason, attempts)


async def claim(
    gateway: CommandGateway,
    pool: str,
    name: str,
    *,
    actor: str,
    claim_id: str,
    labels: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    providers: Sequence[str] = (),
    ttl_seconds: int | None = None,
    env_refusal: str | None = None,
    template: str | None = None,
    revisions: Mapping[int, int | None] | None = None,
    pinned: int | None = None,
    timeout: float = 30.0,
) -> ClaimResult:
    """Adopt a Ready member of ``pool`` under ``name`` (warm), or say why not (cold).
    ``env_refusal``: why this door cannot deliver per-claim env or providers warm (a claim
    with either is then cold); ``template``, ``revisions``: only a member made from that
    template, of one of those revisions (the ones the claimant may have: ``pool_claims``), is
    adopted, with the time to live given for its revision (None: any member, ``ttl_seconds``);
    ``pinned``: the revision the request named, for the cold reason."""
    if (env or providers) and env_refusal is not None:
        what = "env and providers" if env and providers else "env" if env else "providers"
        return cold(f"per-claim {what}: a cold start ({env_refusal})")
    asked = Asked(dict(labels or {}), dict(env or {}), list(providers), ttl_seconds)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    among = None if revisions is None else sorted(revisions)
    settled, candidates = await _first(gateway, pool, name, claim_id, template, among, deadline)
    if settled is not None:  # a retried claim: its answer says what the first one's said
        return replace(settled, reason=settled.reason + asked.note()) if settled.warm else settled
    adopting = _ADOPTING.setdefault(gateway, {})
    attempts = 0
    while loop.time() < deadline:
        if candidates is None:
            candidates = await _candidates(gateway, pool, template, among)
        if not candidates:
            of = "" if pinned is None else f" of template revision {pinned}"
            return cold(f"no Ready member of pool {pool!r}{of} is unclaimed", attempts)
        if all(member in adopting for member in candidates):
            await _one_decided([adopting[m] for m in candidates], deadline)
            candidates = None  # read again: what those adoptions left
            continue
        for member in candidates:
            if member in adopting:  # another claim here asks for it: the next one
                continue
            attempts += 1
            adopting[member] = decided = asyncio.Event()
            try:
                given = await _for_member(gateway, member, asked, revisions)
                outcome = await _adopt(gateway, member, name, actor, claim_id, given, deadline)
            finally:
                del adopting[member]
                decided.set()
            if outcome is None:
                return cold(f"the adoption of {member!r} was not decided in time", attempts)
            if outcome.accepted:
                result = await _bound(gateway, member, name, claim_id, deadline)
                reason = result.reason + (asked.note() if result.warm else "")
                return ClaimResult(result.warm, result.member, reason, attempts)
            if outcome.code not in (Code.FAILED_PRECONDITION, Code.NOT_FOUND):
                return cold(f"the adoption of {member!r} was refused: {outcome.message}", attempts)
        candidates = None
    return cold(f"no member adopted within {timeout:g}s", attempts)


async def _one_decided(events: list[asyncio.Event], deadline: float) -> None:
    """Until one of ``events`` is set, or ``deadline``."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    timeout = max(deadline - asyncio.get_running_loop().time(), 0)
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def _shuffled(keys: list[str]) -> list[str]:
    random.shuffle(keys)
    return keys


async def _candidates(
    gateway: CommandGateway, pool: str, template: str | None, revisions: list[int] | None
) -> list[str]:
    rows = await gateway.pool.fetch(_CANDIDATES, pool, CANDIDATES, template, revisions)
    return _shuffled([r["key"] for r in rows])


async def _first(
    gateway: CommandGateway,
    pool: str,
    name: str,
    claim_id: str,
    template: str | None,
    revisions: list[int] | None,
    deadline: float,
) -> tuple[ClaimResult | None, list[str] | None]:
    """What a claim need not (or must not) adopt for: its name bound already (a retried claim),
    the member it adopted before (a retry: wait for that one), or a name taken (cold: the
    create the caller makes is refused, and no member is spent on it); else the candidates,
    read in the same round trip."""
    row = await gateway.pool.fetchrow(_FIRST, name, pool, claim_id, CANDIDATES, template, revisions)
    assert row is not None  # one row, whether the name has one or not
    bound = row["bound_to"]
    if bound is not None:
        if row["claim_id"] == claim_id:
            return ClaimResult(True, bound, f"adopted {bound!r} (retried)"), None
        return cold(f"the name {name!r} is taken (adopted sandbox {bound!r})"), None
    if row["phase"] is not None and row["phase"] != "Deleted":
        return cold(f"the name {name!r} is taken (a sandbox in {row['phase']})"), None
    if row["adopted"] is not None:
        return await _bound(gateway, row["adopted"], name, claim_id, deadline), None
    return None, _shuffled(list(row["candidates"]))


@dataclass(frozen=True, slots=True)
class Asked:
    """What a claim gives the member it adopts besides the name."""

    labels: dict[str, str]
    env: dict[str, str]
    providers: list[str]
    ttl_seconds: int | None

    def note(self) -> str:
        """What the warm answer's reason adds: where the claim's env and providers reach."""
        if not (self.env or self.providers):
            return ""
        return (
            "; its env and providers reach every exec through sandstream (HTTP, OpenShell, "
            "the SDK), while the member's own process keeps the template's environment until "
            "its next start"
        )


async def _for_member(
    gateway: CommandGateway,
    member: str,
    asked: Asked,
    ttls: Mapping[int, int | None] | None,
) -> Asked:
    """``asked`` with the time to live given for ``member``'s template revision (an outdated
    member: its own revision's, as the rest of what it runs is its revision's). Read only
    when the revisions' TTLs differ."""
    if not ttls:
        return asked
    given = set(ttls.values())
    if len(given) > 1:
        revision = await gateway.pool.fetchval(
            "SELECT (template->>'revision')::int FROM sandboxes WHERE key = $1", member
        )
        given = {ttls.get(revision, asked.ttl_seconds)}
    [ttl] = given
    return asked if ttl == asked.ttl_seconds else replace(asked, ttl_seconds=ttl)


async def _adopt(
    gateway: CommandGateway,
    member: str,
    name: str,
    actor: str,
    claim_id: str,
    asked: Asked,
    deadline: float,
) -> Any:
    command = AdoptSandbox(
        type="AdoptSandbox",
        command_id=adopt_command_id(claim_id, member),
        key=member,
        occurred_at=now(),
        actor=actor,
        claimant=name,
        claim_id=claim_id,
        labels=asked.labels,
        ttl_seconds=asked.ttl_seconds,
        env=asked.env,
        providers=asked.providers,
    )
    wait = max(deadline - asyncio.get_running_loop().time(), 0.001)
    return (await gateway.submit(command, wait)).outcome


async def _bound(
    gateway: CommandGateway, member: str, name: str, claim_id: str, deadline: float
) -> ClaimResult:
    """Wait for the processor's second step: the name bound to ``member`` (warm), or refused
    and the adoption abandoned (cold: the name is someone else's)."""
    loop = asyncio.get_running_loop()
    while True:
        mark = gateway.feed.mark()
        row = await gateway.pool.fetchrow(_BINDING, name, member, claim_id)
        assert row is not None  # one row, whether the name has one or not
        if row["bound_to"] is not None and row["claim_id"] == claim_id:
            # This claim's name: bound to ``member``, or (a retried claim that raced its own
            # first adoption) to the member adopted first, the other one being abandoned.
            return ClaimResult(True, row["bound_to"], f"adopted {row['bound_to']!r}")
        if row["abandoned"] is not False:  # abandoned (or gone): the name went to another
            taken = "taken" if row["bound_to"] is None else "bound to another"
            return cold(f"the name {name!r} is {taken}: adoption of {member!r} abandoned")
        remaining = deadline - loop.time()
        if remaining <= 0:
            return cold(f"adopted {member!r}, but its name was not bound in time")
        await gateway.feed.wait(mark, min(remaining, gateway.poll_interval))
