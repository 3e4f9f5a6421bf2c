"""The claim path of ``POST /v1/sandboxes``: a create naming a template that has a warm pool
first tries to adopt one of the pool's Ready members (``claims.claim``), and falls back to the
cold create from the template when none can be; the answer's ``claim`` says which and why
(docs/pools.md, "Claims from a pool").

Cold without trying, stated as the reason: a pinned template revision other than the newest
(members are made from the newest), a time to live (a member keeps none: it waits in the pool
untimed), per-claim env or providers (``claims.claim`` says why). Every claim served is
counted for the pool's status (``pool_claims``) and the metrics, with the request's time in the
API by path.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

from fastapi.responses import JSONResponse

from events.commands import CreateSandbox
from events.outcomes import Code
from services.api import claims
from services.api.deps import ApiState
from services.api.models import CreateSandboxRequest
from services.api.readmodel import ClaimOutcome, CommandStatus
from services.common import metrics
from services.common import pools as store
from services.common.pools import PoolInfo
from services.common.tokens import Principal

CLAIM_TIMEOUT = 30.0  # seconds a claim may take to adopt and bind before it goes cold


async def create_or_claim(
    state: ApiState,
    principal: Principal,
    body: CreateSandboxRequest,
    command: CreateSandbox,
    create: Callable[[], Awaitable[JSONResponse]],
) -> JSONResponse | None:
    """The answer to a create from a pooled template: a member adopted, or ``create()`` (the
    cold create). None: the template has no pool, the caller creates as usual."""
    if command.template is None:
        return None
    async with state.pool.acquire() as conn:
        pools = await store.pools_of_template(conn, command.template.name)
        current = (await store.template_revisions(conn, [command.template.name])).get(
            command.template.name
        )
    if not pools:
        return None
    started = time.perf_counter()
    pool, result = pools[0], None
    why_not = _cold_at_once(state, body, command, current)
    if why_not is None:
        for pool in pools:
            result = await claims.claim(
                state.gateway,
                pool.name,
                body.name,
                actor=principal.name,
                claim_id=command.command_id,
                labels=body.overrides.labels if body.overrides else None,
                env=body.overrides.env if body.overrides else None,
                providers=body.providers,
                timeout=CLAIM_TIMEOUT,
            )
            if result.warm:
                break
        assert result is not None
        why_not = None if result.warm else result.reason
    if result is not None and result.warm and result.member is not None:
        answer = await _warm(state, body.name, command.command_id, pool, result)
        await _count(state, pool, command, True, result.reason, started)
        return answer
    reason = why_not or "no member adopted"
    answer = _with_claim(await create(), ClaimOutcome(pool=pool.name, warm=False, reason=reason,
                                                      member=None))  # fmt: skip
    if answer.status_code < 300:  # a refused create (the name taken, say) served no claim
        await _count(state, pool, command, False, reason, started)
    return answer


def _cold_at_once(
    state: ApiState, body: CreateSandboxRequest, command: CreateSandbox, current: int | None
) -> str | None:
    assert command.template is not None
    if body.template is not None and body.template.revision not in (None, current):
        return (
            f"template revision {command.template.revision} asked for; the pool's members are "
            f"of the newest ({current})"
        )
    if command.ttl_seconds is not None:
        return "a time to live needs a cold create (a pool member waits untimed)"
    return None


async def _warm(
    state: ApiState, name: str, claim_id: str, pool: PoolInfo, result: claims.ClaimResult
) -> JSONResponse:
    assert result.member is not None
    row = await state.pool.fetchrow(
        "SELECT sandbox_id, phase, generation, version, identity FROM sandboxes WHERE key = $1",
        result.member,
    )
    status = CommandStatus(
        command_id=claim_id,
        name=name,
        command_type="AdoptSandbox",
        status="accepted",
        code=Code.OK,
        message=f"sandbox {name!r} is pool member {result.member!r}: {result.reason}",
        sandbox_id=row["sandbox_id"] if row else None,
        phase=row["phase"] if row else None,
        generation=row["generation"] if row else None,
        version=row["version"] if row else None,
        identity=row["identity"] if row else None,
        claim=ClaimOutcome(pool=pool.name, warm=True, reason=result.reason, member=result.member),
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


async def _count(
    state: ApiState, pool: PoolInfo, command: CreateSandbox, warm: bool, reason: str, started: float
) -> None:
    """Count the claim once: a retry of the request (its command id) is not a claim again."""
    seconds = time.perf_counter() - started
    async with state.pool.acquire() as conn:
        counted = await store.record_claim(
            conn, pool.name, command.command_id, command.key, warm, reason, seconds
        )
    if counted:
        path = "warm" if warm else "cold"
        metrics.POOL_CLAIMS.labels(pool.name, path).inc()
        metrics.POOL_CLAIM_SECONDS.labels(path).observe(seconds)
