"""The values a launch hands to the driver, read from PostgreSQL at launch time.

The executor asks for the values of the providers attached to the sandbox *now* (the row's
``providers``), decrypted with the installation key. The events it acts on carry provider names
only, so a launch after a rotation, a restart or a redelivery always gets the current values.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeAlias

import asyncpg

from drivers.protocol import DriverError
from projections.store import CONNECTION_ERRORS
from services.common import providers
from services.common.credentials import CredentialKeyError, Vault, load_key
from services.common.providers import LaunchValues
from services.common.settings import Settings

CredentialSource: TypeAlias = Callable[[str], Awaitable[LaunchValues]]


@dataclass
class LaunchCredentials:
    """``await source(key)``: the environment values of sandbox ``key``'s providers and the
    revisions they are of (reported with the launch's result).

    Failures are DriverErrors, so the executor retries a lost PostgreSQL (retryable) and
    reports a missing or wrong key at once. Messages name providers and keys, never values.
    """

    settings: Settings
    pool: asyncpg.Pool[asyncpg.Record]
    _vault: Vault | None = field(default=None, repr=False)

    async def __call__(self, key: str) -> LaunchValues:
        try:
            attached = await self.pool.fetchval(
                "SELECT cardinality(providers) FROM sandboxes WHERE key = $1", key
            )
            if not attached:
                return LaunchValues()
            if self._vault is None:
                self._vault = await providers.vault(self.pool, load_key(self.settings))
            async with self.pool.acquire() as conn:
                return await providers.launch_environment(conn, self._vault, key)
        except CredentialKeyError as exc:
            raise DriverError(f"credentials unavailable: {exc}", retryable=False) from exc
        except CONNECTION_ERRORS as exc:
            raise DriverError(
                f"credentials unavailable: PostgreSQL unreachable ({type(exc).__name__})",
                retryable=True,
            ) from exc
