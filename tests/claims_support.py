"""Helpers for the claim tests: pool members created as the pool controller would (an ordinary
CreateSandbox with ``pool``), and what the rows say about adoptions and names."""

from __future__ import annotations

import secrets
import string
from typing import Any

from harness import eventually

from events.commands import CreateSandbox
from events.common import SandboxSpec, TemplateRef
from events.publisher import new_command_id, now
from services.api.gateway import CommandGateway

SLEEPER = ["sh", "-c", "exec sleep 3600"]
_ALPHABET = string.ascii_lowercase + string.digits


def member_key(pool: str) -> str:
    return f"{pool}-{''.join(secrets.choice(_ALPHABET) for _ in range(8))}"


async def create_members(
    gateway: CommandGateway,
    pool: str,
    count: int,
    image: str,
    template: TemplateRef | None = None,
    **spec: Any,
) -> list[str]:
    """``count`` members of ``pool``, created and accepted (not yet Ready); made from
    ``template`` as the controller's are (a door's claim adopts only such members)."""
    keys = [member_key(pool) for _ in range(count)]
    for key in keys:
        command = CreateSandbox(
            type="CreateSandbox",
            command_id=new_command_id(),
            key=key,
            occurred_at=now(),
            actor="pool-controller",
            spec=SandboxSpec(image=image, command=SLEEPER, **spec),
            pool=pool,
            template=template,
        )
        outcome = (await gateway.submit(command, 30)).outcome
        assert outcome is not None and outcome.accepted, outcome
    return keys


async def phases(pool: Any, keys: list[str]) -> dict[str, str]:
    rows = await pool.fetch("SELECT key, phase FROM sandboxes WHERE key = ANY($1)", keys)
    return {r["key"]: r["phase"] for r in rows}


async def all_ready(pool: Any, keys: list[str], timeout: float = 90) -> None:
    await eventually(
        lambda: phases(pool, keys),
        lambda found: sorted(found.values()) == ["Ready"] * len(keys),
        timeout=timeout,
        what=f"{len(keys)} members Ready",
    )


async def adoptions(pool: Any, pool_name: str) -> list[dict[str, Any]]:
    """Every member of ``pool_name`` a claim adopted: key, claimant, claim, phase."""
    rows = await pool.fetch(
        "SELECT key, adopted_as, claim_id, phase FROM sandboxes "
        "WHERE pool = $1 AND claim_id IS NOT NULL ORDER BY key",
        pool_name,
    )
    return [dict(r) for r in rows]


async def bindings(pool: Any) -> dict[str, tuple[str, str]]:
    """Every bound name: name -> (member, claim id)."""
    rows = await pool.fetch("SELECT name, key, claim_id FROM sandbox_names")
    return {r["name"]: (r["key"], r["claim_id"]) for r in rows}
