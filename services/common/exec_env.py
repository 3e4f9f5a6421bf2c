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

The claim's part (the spec's env, the providers it attached) comes with the row the door read
to find the sandbox (``ClaimPart``), not from a read of its own: only the providers' values are
read at the exec, and only when the claim attached some.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from projections.lifecycle import Sandbox
from projections.store import CONNECTION_ERRORS
from services.common import providers
from services.common.credentials import CredentialKeyError, Vault
from services.common.providers import Pool


@dataclass(frozen=True, slots=True)
class ClaimPart:
    """The claim's part of an adopted pool member's row: its spec's env (the claim's merged
    in) and the providers the claim attached."""

    env: Mapping[str, str]
    providers: tuple[str, ...]


def claim_part(row: Sandbox) -> ClaimPart | None:
    """The claim's part of ``row``; None for a sandbox no claim adopted (its runtime was
    started with its spec: its execs get the request's variables alone)."""
    if row.pool is None or row.adopted_generation is None:
        return None
    return ClaimPart(dict(row.spec.env), row.claim_providers)


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
    claim: ClaimPart | None,
    asked: Mapping[str, str],
) -> dict[str, str]:
    """The environment of an exec in sandbox ``key`` (``claim``: the claim's part of the row
    just read, ``SandboxView.claim``) asking for ``asked``."""
    if claim is None:
        return dict(asked)
    env = dict(claim.env)
    if not claim.providers:
        return {**env, **asked}
    try:
        async with pool.acquire() as conn:
            env.update(await providers.claim_values(conn, await vault(), key))
    except CredentialKeyError as exc:
        raise ExecEnvUnavailable(f"the claim's provider values cannot be read: {exc}") from exc
    except CONNECTION_ERRORS as exc:
        raise ExecEnvUnavailable(
            f"the claim's env cannot be read: PostgreSQL unreachable ({type(exc).__name__})"
        ) from exc
    return {**env, **asked}
