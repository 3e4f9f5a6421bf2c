"""The provider service: the one place where provider writes are decided, whichever door
they come through (the HTTP routes, the provider-sync controller, the OpenShell API).

- ``update``: store the values (encrypted), then send each attached sandbox its one restart
  command, and answer with the receipt (what will happen to every attached sandbox).
- ``attachment``: the AttachProvider or DetachProvider command a caller may send.
- ``delete``: delete a provider; forced, detach it from every sandbox first.

Who may do what is checked here too (``ScopeMissing``): attaching hands a provider's values to
an agent and detaching takes them away, so both need ``sandbox:write`` and ``provider:write``,
and so does a forced delete (it detaches). Values pass through here on their way into
PostgreSQL and are never logged, published or returned.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final

from events.commands import AttachProvider, DetachProvider, ProviderRotation, RotateCredentials
from events.publisher import new_command_id, now
from projections.credentials import ReceiptLine, plan
from services.api.gateway import CommandGateway, Pool, PublishFailed
from services.common import providers
from services.common.credentials import Vault, load_key
from services.common.providers import Applied, Update
from services.common.settings import Settings
from services.common.tokens import PROVIDER_WRITE, WRITE, Principal

log = logging.getLogger("sandstream.providers")


class ScopeMissing(PermissionError):
    """The caller's token lacks a scope the request needs."""

    def __init__(self, principal: Principal, scope: str, why: str) -> None:
        super().__init__(f"token {principal.name!r} lacks the scope {scope} ({why})")


class ProviderInUse(Exception):
    """A delete without force of a provider that sandboxes have attached."""

    def __init__(self, name: str, sandboxes: list[str]) -> None:
        super().__init__(
            f"provider {name!r} is attached to {', '.join(sandboxes)} (force=true detaches it)"
        )


def require_scopes(principal: Principal, why: str, *scopes: str) -> None:
    for scope in scopes:
        if scope not in principal.scopes:
            raise ScopeMissing(principal, scope, why)


# Attaching hands a provider's values to an agent, detaching takes them away: both are
# sandbox writes and provider writes.
ATTACHING: Final = (WRITE, PROVIDER_WRITE)


@dataclass(frozen=True, slots=True)
class Deleted:
    name: str
    detached: list[str]  # the sandboxes it was detached from (a forced delete)


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
        incarnations = {a.change.provider: a.incarnation for a in applied}
        lines = plan(rotations, attached, restart, incarnations)
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

    async def attachment(
        self,
        kind: type[AttachProvider | DetachProvider],
        sandbox: str,
        provider: str,
        *,
        principal: Principal,
        command_id: str | None = None,
        expected_version: int | None = None,
        restart: bool = True,
    ) -> AttachProvider | DetachProvider:
        """The command that attaches ``provider`` to ``sandbox`` or detaches it (a Ready
        sandbox restarts without its values unless not ``restart``), for the door to submit;
        ScopeMissing, or ProviderMissing (an attach of a provider that does not exist)."""
        require_scopes(principal, "attaching or detaching a provider", *ATTACHING)
        common = {
            "command_id": command_id or new_command_id(),
            "key": sandbox,
            "occurred_at": now(),
            "actor": principal.name,
            "expected_version": expected_version,
            "provider": provider,
        }
        if kind is DetachProvider:
            return DetachProvider(type="DetachProvider", restart=restart, **common)
        async with self.pool.acquire() as conn:
            if await providers.get_provider(conn, provider) is None:
                raise providers.ProviderMissing(provider)
        return AttachProvider(type="AttachProvider", **common)

    async def delete(
        self, name: str, *, principal: Principal, force: bool = False, restart: bool = True
    ) -> Deleted:
        """Delete provider ``name``; refused (ProviderInUse) while attached, unless ``force``:
        then detached from every sandbox first (each Ready one restarting without its values
        unless not ``restart``), which needs the scopes of a detach as well."""
        require_scopes(principal, "deleting a provider", PROVIDER_WRITE)
        if force:
            require_scopes(principal, "force detaches the provider from its sandboxes", *ATTACHING)
        async with self.pool.acquire() as conn:
            if await providers.get_provider(conn, name) is None:
                raise providers.ProviderMissing(name)
            attached = [s.key for s in await providers.attached_sandboxes(conn, [name])]
        if attached and not force:
            raise ProviderInUse(name, attached)
        detached = await self._detach_everywhere(name, principal.name, restart) if force else []
        async with self.pool.acquire() as conn:
            await providers.delete_provider(conn, name)
        return Deleted(name, detached)

    async def _detach_everywhere(self, provider: str, actor: str, restart: bool) -> list[str]:
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
                restart=restart,
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
