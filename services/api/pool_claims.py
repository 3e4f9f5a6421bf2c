"""The claim path of a create naming a template that has a warm pool, shared by both doors that
create (``POST /v1/sandboxes`` and OpenShell's CreateSandbox with ``workload_template``): first
try to adopt one of the pool's Ready members (``claims.claim``), and fall back to the cold create
from the template when none can be; the outcome says which and why (docs/pools.md, "Claims from
a pool").

A member is what its template revision made it, which need not be the newest: an outdated
member (a roll, ``OnReplenish``, a pool pointed at another template) has its own revision's
providers, grace period and idle timeout. So a claim adopts only a member of the template it
names, of a revision the claimant could create from itself: the checks a door makes of a
create's spec (providers need ``provider:write``, the token's cap on the grace period, an idle
timeout only where the name can be suspended, the template's labels not changed) are made of
each revision the members run (``vetted``), and a pinned revision admits only itself. A claim's
time to live (its own, else that revision's, else the default a create gets) is applied at the
adoption, counted from it.

Cold without trying, stated as the reason: a door's own reason (OpenShell's per-claim command),
per-claim env or providers where the door's driver cannot pass them to an exec privately
(``claims.claim`` says why: the Kubernetes driver), no member of a revision the claimant may
have (each refused revision and why). Every claim served is counted for the pool's status
(``pool_claims``) and the metrics, with the request's time in the door by path.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from drivers.protocol import exec_env_refusal
from events.commands import CreateSandbox
from events.outcomes import Code
from services.api import claims
from services.api.deps import ApiState, Pool
from services.api.gateway import CommandGateway
from services.api.models import CreateSandboxRequest
from services.api.readmodel import ClaimOutcome, CommandStatus
from services.common import metrics, templates
from services.common import pools as store
from services.common.pools import Conn, PoolInfo
from services.common.suspend import suspend_refusal
from services.common.tokens import PROVIDER_WRITE, Principal, stop_timeout_refusal

CLAIM_TIMEOUT = 30.0  # seconds a claim may take to adopt and bind before it goes cold


@dataclass(frozen=True, slots=True)
class Caller:
    """Who claims, as a door knows it: what the checks of a create's spec need."""

    principal: Principal
    max_stop_timeout: int  # the cap for a token without its own
    default_ttl: int | None  # a create's time to live when neither it nor its template sets one
    unsuspendable: str | None = None  # why the claimant's name cannot be suspended here


def member_refusal(made: templates.Resolved, caller: Caller) -> str | None:
    """Why ``caller`` may not have a sandbox made as ``made`` (None: it may): the checks both
    doors make of a create's spec, made of a member's revision."""
    if made.providers and PROVIDER_WRITE not in caller.principal.scopes:
        return f"it attaches providers ({', '.join(made.providers)}), which needs {PROVIDER_WRITE}"
    why = stop_timeout_refusal(
        caller.principal, caller.max_stop_timeout, made.spec.stop_timeout_seconds
    )
    if why is not None:
        return f"its stop_timeout_seconds: {why}"
    if made.spec.idle_suspend_seconds is not None and caller.unsuspendable is not None:
        return f"its idle timeout: the sandbox could not be suspended ({caller.unsuspendable})"
    return None


def vetted(
    found: Sequence[templates.TemplateInfo],
    overrides: templates.Overrides,
    caller: Caller,
    pinned: int | None,
) -> tuple[dict[int, int | None], list[str]]:
    """Of the revisions the members run (``found``), those ``caller`` may have with its
    ``overrides`` (only ``pinned`` if set), each with the time to live its adoption sets; and
    why each other one may not be (pure)."""
    allowed: dict[int, int | None] = {}
    refused: list[str] = []
    for info in found:
        if pinned is not None and info.revision != pinned:
            continue
        try:
            made = templates.apply(info, overrides)
        except templates.OverrideRefused as exc:
            why: str | None = str(exc)
        else:
            why = member_refusal(made, caller)
        if why is None:
            allowed[info.revision] = made.ttl_seconds or caller.default_ttl
        else:
            refused.append(f"revision {info.revision}: {why}")
    return allowed, refused


@dataclass(frozen=True, slots=True)
class Claim:
    """A create from a pooled template, tried as a claim: warm (``result.member`` adopted under
    the command's name) or cold and why (the door then sends the create itself)."""

    pool: PoolInfo
    result: claims.ClaimResult
    started: float  # perf_counter at the claim's start, for its time by path

    @property
    def warm(self) -> bool:
        return self.result.warm and self.result.member is not None

    @property
    def outcome(self) -> ClaimOutcome:
        reason = self.result.reason if self.result.warm == self.warm else "no member adopted"
        member = self.result.member if self.warm else None
        return ClaimOutcome(pool=self.pool.name, warm=self.warm, reason=reason, member=member)


async def claim_first(
    gateway: CommandGateway,
    command: CreateSandbox,
    caller: Caller,
    overrides: templates.Overrides,
    *,
    pinned: int | None = None,
    cold_because: str | None = None,
    driver: object | None = None,
) -> Claim | None:
    """The claim a create from a template is: ``command``'s name adopting a Ready member of
    the template's pool (its command id the claim id: a retried request is the same claim), or
    cold and why. None: no template, or no pool of it (the door creates as usual).
    ``caller``: who claims; ``overrides``: the request's own labels, env, providers and time
    to live (beyond the template's); ``pinned``: the template revision the request asked for;
    ``cold_because``: a door's own reason to go cold without trying; ``driver``: the door's
    exec driver (whether it can deliver the claim's env and providers warm)."""
    if command.template is None:
        return None
    name = command.template.name
    async with gateway.pool.acquire() as conn:
        pools = await store.pools_of_template(conn, name)
        found = (
            await templates.member_revisions(conn, name, [p.name for p in pools]) if pools else []
        )
    if not pools:
        return None
    started = time.perf_counter()
    if cold_because is not None:
        return Claim(pools[0], claims.cold(cold_because), started)
    allowed, refused = vetted(found, overrides, caller, pinned)
    if not allowed and refused:
        why = "no member of a revision this request may have: " + "; ".join(refused)
        return Claim(pools[0], claims.cold(why), started)
    for pool in pools:
        result = await claims.claim(
            gateway,
            pool.name,
            command.key,
            actor=command.actor,
            claim_id=command.command_id,
            labels=overrides.labels,
            env=overrides.env,
            providers=overrides.providers,
            ttl_seconds=command.ttl_seconds,
            env_refusal=exec_env_refusal(driver),
            template=name,
            revisions=allowed,
            pinned=pinned,
            timeout=CLAIM_TIMEOUT,
        )
        if result.warm:
            break
    return Claim(pool, result, started)


async def count(pool: Pool, claim: Claim, command: CreateSandbox) -> None:
    """Count the claim once: a retry of the request (its command id) is not a claim again."""
    async with pool.acquire() as conn:
        await count_on(conn, claim, command)


async def count_on(conn: Conn, claim: Claim, command: CreateSandbox) -> None:
    """``count`` on a connection the caller holds."""
    seconds = time.perf_counter() - claim.started
    served = claim.outcome
    counted = await store.record_claim(
        conn, served.pool, command.command_id, command.key, served.warm, served.reason, seconds
    )
    if counted:
        path = "warm" if served.warm else "cold"
        metrics.POOL_CLAIMS.labels(served.pool, path).inc()
        metrics.POOL_CLAIM_SECONDS.labels(path).observe(seconds)


def request_overrides(body: CreateSandboxRequest) -> templates.Overrides:
    """What a create from a template over HTTP changes of the template (the rule:
    services/common/templates.py)."""
    asked = body.overrides
    env, labels = (asked.env, asked.labels) if asked is not None else ({}, {})
    return templates.Overrides(env, labels, body.ttl_seconds, body.providers)


async def create_or_claim(
    state: ApiState,
    principal: Principal,
    body: CreateSandboxRequest,
    command: CreateSandbox,
    create: Callable[[], Awaitable[JSONResponse]],
) -> JSONResponse | None:
    """The HTTP answer to a create from a pooled template: a member adopted, or ``create()``
    (the cold create). None: the template has no pool, the caller creates as usual."""
    settings = state.settings
    caller = Caller(
        principal,
        settings.api_max_stop_timeout_seconds,
        settings.default_ttl_seconds,
        suspend_refusal(settings, body.name),
    )
    overrides = request_overrides(body)
    pinned = body.template.revision if body.template is not None else None
    claim = await claim_first(
        state.gateway, command, caller, overrides, pinned=pinned, driver=state.exec_driver
    )
    if claim is None:
        return None
    if claim.warm:
        async with state.pool.acquire() as conn:  # one acquisition (each ends in a reset)
            answer = await _warm(conn, body.name, command.command_id, claim)
            await count_on(conn, claim, command)
        return answer
    answer = _with_claim(await create(), claim.outcome)
    if answer.status_code < 300:  # a refused create (the name taken, say) served no claim
        await count(state.pool, claim, command)
    return answer


async def _warm(conn: Conn, name: str, claim_id: str, claim: Claim) -> JSONResponse:
    served = claim.outcome
    row = await conn.fetchrow(
        "SELECT sandbox_id, phase, generation, version, identity FROM sandboxes WHERE key = $1",
        served.member,
    )
    status = CommandStatus(
        command_id=claim_id,
        name=name,
        command_type="AdoptSandbox",
        status="accepted",
        code=Code.OK,
        message=f"sandbox {name!r} is pool member {served.member!r}: {served.reason}",
        sandbox_id=row["sandbox_id"] if row else None,
        phase=row["phase"] if row else None,
        generation=row["generation"] if row else None,
        version=row["version"] if row else None,
        identity=row["identity"] if row else None,
        claim=served,
    )
    return JSONResponse(
        status.model_dump(mode="json"), 201, headers={"Location": f"/v1/sandboxes/{name}"}
    )


def _with_claim(answer: JSONResponse, claim: ClaimOutcome) -> JSONResponse:
    """The cold create's answer with the claim's outcome added (a 2xx: its status body)."""
    if answer.status_code >= 300:
        return answer
    body = json.loads(bytes(answer.body))
    body["claim"] = claim.model_dump(mode="json")
    headers = {k: v for k, v in answer.headers.items() if k.lower() == "location"}
    return JSONResponse(body, answer.status_code, headers=headers)
