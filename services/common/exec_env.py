"""The environment of a command run through sandstream's exec (HTTP ``POST
/v1/sandboxes/{name}/exec``, OpenShell's ExecSandbox, so the SDK too) in a pool member a claim
adopted with env or providers (docs/pools.md, "A claim's env and providers").

The member's process was started before the claim, with the template's environment; the claim's
env (merged into the row's spec) and the values of the providers it attached reach the commands
run through exec instead: each exec gets the spec's env, then those providers' values (read and
decrypted now, so a rotation reaches the next exec without a restart), then the request's own
variables. The values travel from PostgreSQL through this API process to the driver's exec
session (the Podman driver: the session's body over the Podman socket) and nowhere else; the
log holds the providers' names only. Any other sandbox's exec gets the request's variables
alone, as before (its runtime was started with its spec).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from projections.store import CONNECTION_ERRORS
from services.common import providers
from services.common.credentials import CredentialKeyError, Vault
from services.common.providers import Pool

# The claim's part of a member's row: set only for a claim that brought env or providers.
_ROW: Final = (
    "SELECT spec->'env' AS env, claim_providers FROM sandboxes "
    "WHERE key = $1 AND adopted_generation IS NOT NULL"
)


class ExecEnvUnavailable(Exception):
    """The claim's values cannot be read now (the credentials key missing here, PostgreSQL
    unreachable): the exec is refused rather than run without them. Names no value."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def exec_environment(
    pool: Pool,
    vault: Callable[[], Awaitable[Vault]],
    key: str,
    member_of: str | None,
    asked: Mapping[str, str],
) -> dict[str, str]:
    """The environment of an exec in sandbox ``key`` (``member_of``: its pool, None for a
    sandbox created for no pool, which needs no read) asking for ``asked``."""
    if member_of is None:
        return dict(asked)
    try:
        row = await pool.fetchrow(_ROW, key)
        if row is None:
            return dict(asked)
        env: dict[str, str] = json.loads(row["env"]) if row["env"] is not None else {}
        if row["claim_providers"]:
            async with pool.acquire() as conn:
                env.update(await providers.claim_values(conn, await vault(), key))
    except CredentialKeyError as exc:
        raise ExecEnvUnavailable(f"the claim's provider values cannot be read: {exc}") from exc
    except CONNECTION_ERRORS as exc:
        raise ExecEnvUnavailable(
            f"the claim's env cannot be read: PostgreSQL unreachable ({type(exc).__name__})"
        ) from exc
    return {**env, **asked}
