"""Provider updates: store the values (encrypted), then send each attached sandbox its one
restart command, and answer with the receipt (what will happen to every attached sandbox).

The API route and the provider-sync controller both go through ``ProviderService``. Values pass
through here on their way into PostgreSQL and are never logged, published or returned.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from events.commands import DetachProvider, ProviderRotation, RotateCredentials
from events.publisher import new_command_id, now
from projections.credentials import ReceiptLine, plan
from services.api.gateway import CommandGateway, Pool, PublishFailed
from services.common import providers
from services.common.credentials import Vault, load_key
from services.common.providers import Applied, Update
from services.common.settings import Settings

log = logging.getLogger("sandstream.providers")


@dataclass(frozen=True, slots=True)
class Receipt:
    applied: list[Applied]
    sandboxes: list[ReceiptLine]
    restart: bool
    unsent: list[str] = field(default_factory=list)  # command ids Kafka did not acknowledge


@dataclass
class ProviderService:
    settings: Settings
    pool: Pool
    gateway: CommandGateway
    _vault: Vault | None = field(default=None, repr=False)

    async def vault(self) -> Vault:
        """The installation's vault; CredentialKeyError when the key is missing or bad."""
        if self._vault is None:
            self._vault = await providers.vault(self.pool, load_key(self.settings))
        return self._vault

    async def update(
        self,
        updates: Iterable[Update],
        *,
        actor: str,
        restart: bool = True,
        create: bool | None = False,
        at: datetime | None = None,
    ) -> Receipt:
        """Store ``updates`` in one transaction, then publish one RotateCredentials per
        attached live sandbox of the rotated providers (restart or recorded skip)."""
        vault = await self.vault()
        async with self.pool.acquire() as conn:
            applied = await providers.apply_updates(
                conn, vault, list(updates), at or now(), create=create
            )
            rotations = {a.change.provider: a.revision for a in applied if a.change.rotated}
            attached = await providers.attached_sandboxes(conn, rotations) if rotations else []
        lines = plan(rotations, attached, restart)
        commands = [
            RotateCredentials(
                type="RotateCredentials",
                command_id=line.command_id,
                key=line.sandbox,
                occurred_at=now(),
                actor=actor,
                rotations=[
                    ProviderRotation(provider=p, revision=rotations[p]) for p in line.providers
                ],
                restart=restart,
            )
            for line in lines
        ]
        unsent = await self._publish(commands)
        log.info(
            "providers updated by %s: %s; %d attached sandboxes (%d restarts)",
            actor,
            ", ".join(f"{a.change.provider}@{a.revision}" for a in applied),
            len(lines),
            sum(1 for line in lines if line.action == "restart"),
        )
        return Receipt(applied, lines, restart, unsent)

    async def detach_everywhere(self, provider: str, actor: str) -> list[str]:
        """Send DetachProvider to every live sandbox that has ``provider`` attached."""
        async with self.pool.acquire() as conn:
            attached = await providers.attached_sandboxes(conn, [provider])
        commands = [
            DetachProvider(
                type="DetachProvider",
                command_id=new_command_id(),
                key=s.key,
                occurred_at=now(),
                actor=actor,
                provider=provider,
            )
            for s in attached
        ]
        await self._publish(commands)
        return [s.key for s in attached]

    async def _publish(self, commands: list[RotateCredentials] | list[DetachProvider]) -> list[str]:
        results = await asyncio.gather(
            *(self.gateway.submit(c, None) for c in commands), return_exceptions=True
        )
        unsent = []
        for command, result in zip(commands, results, strict=True):
            if isinstance(result, PublishFailed):
                unsent.append(command.command_id)
            elif isinstance(result, BaseException):
                raise result
        return unsent
