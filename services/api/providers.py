"""The provider service: the one place where provider writes are decided, whichever door
they come through (the HTTP routes, the provider-sync controller, the OpenShell API).

- ``update``: store the values (encrypted) and each attached sandbox's one restart command in
  one transaction, send the commands, and answer with the receipt (what will happen to every
  attached sandbox, and which commands Kafka has not acknowledged yet: pending).
- ``rotate``: rotate one key to its stored value (OpenShell's RotateProviderCredential of a
  static credential): the next revision, with the same restarts and receipt as an update.
- ``attachment``: the AttachProvider or DetachProvider command a caller may send.
- ``delete``: delete a provider (refused while a live template names it, forced or not);
  forced, detach it from every sandbox (the DetachProvider commands stored in the delete's
  transaction, then sent).
- ``relay``: send the stored commands Kafka has not acknowledged yet, until it does (every
  process that holds a ProviderService runs it: docs/adr/0005).

Each write may carry a request id (``request_id``: the commands' ``command_id``, one
namespace with them, services/api/idempotency.py): the id is recorded in the write's own
transaction with a fingerprint of the request (values as HMACs under the installation's salt)
and the outcome, so a retry with the same id and request gets the first outcome back and
changes nothing (no second revision, no second restart), and the same id with another request
is ``IdempotencyConflict``.

Who may do what is checked here too (``ScopeMissing``): attaching hands a provider's values to
an agent and detaching takes them away, so both need ``sandbox:write`` and ``provider:write``,
and so does a forced delete (it detaches). Values pass through here on their way into
PostgreSQL and are never logged, published or returned.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Final

from pydantic import TypeAdapter

from events.backoff import pause
from events.commands import (
    AttachProvider,
    Command,
    DetachProvider,
    ProviderRotation,
    RotateCredentials,
)
from events.publisher import new_command_id, now
from projections.credentials import ReceiptLine, plan
from services.api import idempotency, provider_outbox
from services.api.gateway import CommandGateway, Pool, PublishFailed, PublishForbidden
from services.common import metrics, providers, templates
from services.common.credentials import Vault, load_key
from services.common.providers import Applied, Conn, Update
from services.common.settings import Settings
from services.common.tokens import PROVIDER_WRITE, WRITE, Principal

log = logging.getLogger("sandstream.providers")


class ScopeMissing(PermissionError):
    """The caller's token lacks a scope the request needs."""

    def __init__(self, principal: Principal, scope: str, needed_for: str) -> None:
        super().__init__(f"token {principal.name!r} lacks the scope {scope} (needed {needed_for})")


class ProviderInUse(Exception):
    """A delete without force of a provider that sandboxes have attached."""

    def __init__(self, name: str, sandboxes: list[str]) -> None:
        super().__init__(
            f"provider {name!r} is attached to {', '.join(sandboxes)}: detach it first (or, "
            "over HTTP, delete with force=true, which detaches it; the CLI's --force)"
        )


class ProviderNamed(ProviderInUse):
    """A delete, forced or not, of a provider that live templates name: every create and
    claim from them (and their pools' refills) would fail. Force detaches a provider from
    sandboxes; taking it out of a template is a template update, so it is refused too."""

    def __init__(self, name: str, templates: list[str]) -> None:
        Exception.__init__(
            self,
            f"provider {name!r} is named by template{'s' if len(templates) > 1 else ''} "
            f"{', '.join(map(repr, templates))}: update or delete "
            f"{'them' if len(templates) > 1 else 'it'} first (force detaches a provider from "
            "sandboxes, never from a template)",
        )
        self.templates = templates


def require_scopes(principal: Principal, needed_for: str, *scopes: str) -> None:
    for scope in scopes:
        if scope not in principal.scopes:
            raise ScopeMissing(principal, scope, needed_for)


# Attaching hands a provider's values to an agent, detaching takes them away: both are
# sandbox writes and provider writes.
ATTACHING: Final = (WRITE, PROVIDER_WRITE)


@dataclass(frozen=True, slots=True)
class Deleted:
    name: str
    detached: list[str]  # the sandboxes it was detached from (a forced delete)
    unsent: list[str] = field(default_factory=list)  # detaches Kafka has not acknowledged yet
    detached_ids: list[str] = field(default_factory=list)  # the DetachProvider command ids


@dataclass(frozen=True, slots=True)
class Receipt:
    applied: list[Applied]
    sandboxes: list[ReceiptLine]
    restart: bool
    # Command ids Kafka has not acknowledged yet: stored with the values, sent by the relay
    # until it does (pending, not lost).
    unsent: list[str] = field(default_factory=list)


async def require_existing(pool: Pool, names: Sequence[str], command_id: str | None = None) -> None:
    """ProviderMissing for the first of ``names`` no provider has: the check of an attach,
    and of a create that attaches providers, at every door. It is made before the command is
    sent; the processor holds no provider check (a provider deleted in between stays attached
    by name, with no values, as docs/providers.md says). A ``command_id`` already recorded is a
    retry (or a conflict): the gateway answers it from the first request, whatever happened to
    the providers since, so it is not checked again."""
    async with pool.acquire() as conn:
        if command_id is not None and await idempotency.recorded(conn, command_id) is not None:
            return
        for name in names:
            if await providers.get_provider(conn, name) is None:
                raise providers.ProviderMissing(name)


def asked_values(vault: Vault, update: Update) -> dict[str, Any]:
    """An update as its request fingerprint sees it: the values as their HMACs."""
    values = {k: vault.fingerprint(update.name, k, v) for k, v in update.values.items()}
    asked = {"name": update.name, "type": update.type, "values": values}
    return asked | ({"keep": sorted(update.keep)} if update.keep else {})


RECEIPT: Final = TypeAdapter(Receipt)
DELETED: Final = TypeAdapter(Deleted)


@dataclass(frozen=True, slots=True)
class Asked:
    """A provider write under a request id: what it is (``verb`` of ``subject``) and the
    fingerprint of what it asks (``idempotency.digest`` of it, values already HMACs)."""

    request_id: str
    verb: str
    subject: str
    fingerprint: str

    @classmethod
    def of(cls, request_id: str | None, verb: str, subject: str, body: Any) -> Asked | None:
        if not request_id:
            return None
        return cls(request_id, verb, subject, idempotency.digest(body))

    async def claim(self, conn: Conn, actor: str) -> Any:
        """The first outcome if this is a retry, None if the id is new (then recorded in the
        caller's transaction); IdempotencyConflict for another request under the id."""
        first = await idempotency.claim(
            conn, self.request_id, self.subject, self.verb, actor, self.fingerprint
        )
        if first is None:
            return None
        assert first.outcome is not None  # recorded in the transaction that wrote the outcome
        return first.outcome


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
        request_id: str | None = None,
    ) -> Receipt:
        """Store ``updates`` and one RotateCredentials per attached live sandbox of the rotated
        providers (restart or recorded skip) in one transaction; then send the commands. A
        create (``create`` True) and an update are different requests under a request id."""
        vault = await self.vault()
        wanted = list(updates)
        in_order = sorted(wanted, key=lambda u: u.name)
        asked = Asked.of(
            request_id,
            "CreateProvider" if create is True else "UpdateProviders",
            ",".join(u.name for u in in_order),
            {"providers": [asked_values(vault, u) for u in in_order],
             "restart": restart, "create": create},
        )  # fmt: skip

        async def apply(conn: Conn) -> list[Applied]:
            return await providers.apply_updates(conn, vault, wanted, at or now(), create=create)

        return await self._rotate(apply, actor=actor, restart=restart, asked=asked)

    async def rotate(
        self,
        name: str,
        key: str,
        *,
        actor: str,
        restart: bool = True,
        request_id: str | None = None,
    ) -> Receipt:
        """Rotate ``key`` of provider ``name`` to its stored value (a static credential has no
        new value to fetch): the same restarts and receipt as an update that replaced it."""
        await self.vault()  # the restarts read the values: CredentialKeyError now if they cannot
        body = {"key": key, "restart": restart}
        asked = Asked.of(request_id, "RotateProviderCredential", name, body)

        async def apply(conn: Conn) -> list[Applied]:
            return [await providers.reapply(conn, name, key, now())]

        return await self._rotate(apply, actor=actor, restart=restart, asked=asked)

    async def _rotate(
        self,
        apply: Callable[[Conn], Awaitable[list[Applied]]],
        *,
        actor: str,
        restart: bool,
        asked: Asked | None,
    ) -> Receipt:
        async with self.pool.acquire() as conn, conn.transaction():
            first = await asked.claim(conn, actor) if asked else None
            if first is None:
                applied, lines, commands = await self._store(conn, apply, actor, restart)
                if asked:
                    kept = RECEIPT.dump_python(Receipt(applied, lines, restart), mode="json")
                    await idempotency.keep_outcome(conn, asked.request_id, kept)
        if first is not None:  # a retry: the first receipt, with what is still unsent now
            receipt = RECEIPT.validate_python(first)
            ids = [line.command_id for line in receipt.sandboxes]
            return replace(receipt, unsent=await provider_outbox.stored(self.pool, ids))
        unsent = await self.send(commands)
        log.info(
            "providers updated by %s: %s; %d attached sandboxes (%d restarts, %d pending)",
            actor,
            ", ".join(f"{a.change.provider}@{a.revision}" for a in applied),
            len(lines),
            sum(1 for line in lines if line.action == "restart"),
            len(unsent),
        )
        return Receipt(applied, lines, restart, unsent)

    async def _store(
        self,
        conn: Conn,
        apply: Callable[[Conn], Awaitable[list[Applied]]],
        actor: str,
        restart: bool,
    ) -> tuple[list[Applied], list[ReceiptLine], list[Command]]:
        """Apply the change and store the restarts it owes (in the caller's transaction)."""
        applied = await apply(conn)
        rotations = {a.change.provider: a.revision for a in applied if a.change.rotated}
        attached = await providers.attached_sandboxes(conn, rotations) if rotations else []
        incarnations = {a.change.provider: a.incarnation for a in applied}
        lines = plan(rotations, attached, restart, incarnations)
        commands: list[Command] = [
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
        await provider_outbox.store(conn, commands)
        return applied, lines, commands

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
        require_scopes(principal, "to attach or detach a provider", *ATTACHING)
        command_id = command_id or new_command_id()
        common = {
            "command_id": command_id,
            "key": sandbox,
            "occurred_at": now(),
            "actor": principal.name,
            "expected_version": expected_version,
            "provider": provider,
        }
        if kind is DetachProvider:
            return DetachProvider(type="DetachProvider", restart=restart, **common)
        await require_existing(self.pool, [provider], command_id)
        return AttachProvider(type="AttachProvider", **common)

    async def delete(
        self,
        name: str,
        *,
        principal: Principal,
        force: bool = False,
        restart: bool = True,
        request_id: str | None = None,
    ) -> Deleted:
        """Delete provider ``name``; refused while a live template names it (ProviderNamed,
        even with ``force``), and while attached (ProviderInUse) unless ``force``:
        then detached from every sandbox (each Ready one restarting without its values unless
        not ``restart``), which needs the scopes of a detach as well. The DetachProvider
        commands are stored in the delete's transaction, then sent."""
        require_scopes(principal, "to delete a provider", PROVIDER_WRITE)
        if force:
            require_scopes(principal, "to detach it from its sandboxes (force)", *ATTACHING)
        asked = Asked.of(request_id, "DeleteProvider", name, {"force": force, "restart": restart})
        async with self.pool.acquire() as conn, conn.transaction():
            first = await asked.claim(conn, principal.name) if asked else None
            if first is not None:
                deleted = DELETED.validate_python(first)
                unsent = await provider_outbox.stored(conn, deleted.detached_ids)
                return replace(deleted, unsent=unsent)
            if not await providers.delete_provider(conn, name):
                raise providers.ProviderMissing(name)
            # After the row's delete (its lock): a template written since is seen here, one
            # being written waits for this transaction and then finds no provider (hold).
            named = await templates.naming(conn, name)
            if named:
                raise ProviderNamed(name, named)  # rolls the delete back, forced or not
            attached = [s.key for s in await providers.attached_sandboxes(conn, [name])]
            if attached and not force:
                raise ProviderInUse(name, attached)  # rolls the delete back
            commands = [
                DetachProvider(
                    type="DetachProvider",
                    command_id=new_command_id(),
                    key=key,
                    occurred_at=now(),
                    actor=principal.name,
                    provider=name,
                    restart=restart,
                )
                for key in attached
            ]
            await provider_outbox.store(conn, commands)
            ids = [c.command_id for c in commands]
            if asked:
                kept = DELETED.dump_python(Deleted(name, attached, detached_ids=ids), mode="json")
                await idempotency.keep_outcome(conn, asked.request_id, kept)
        return Deleted(name, attached, await self.send(commands), ids)

    async def send(self, commands: Sequence[Command]) -> list[str]:
        """Publish stored outbox commands; forget those Kafka acknowledged (or that were
        decided already: a duplicate is harmless), and return the ids of the others, which
        stay stored for the relay."""
        results = await asyncio.gather(
            *(self.gateway.submit(c, None) for c in commands), return_exceptions=True
        )
        sent, unsent, why = [], [], ""
        for command, result in zip(commands, results, strict=True):
            if not isinstance(result, BaseException):
                sent.append(command.command_id)
                continue
            if not isinstance(result, PublishFailed | PublishForbidden):  # the gateway logged it
                log.error("sending %s %s failed: %r (kept for the relay)",
                          command.type, command.command_id, result)  # fmt: skip
            unsent.append(command.command_id)
            why = repr(result.__cause__ or result)
        if sent:
            await provider_outbox.delivered(self.pool, sent)
        if unsent:
            await provider_outbox.failed(self.pool, unsent, why)
        return unsent

    async def relay(self, stop: asyncio.Event) -> None:
        """Until ``stop``: every ``provider_outbox_seconds``, send the stored commands at least
        that old (a request sends its own first) until Kafka acknowledged them. Never ends on
        an error: it logs it and tries again at the next interval."""
        interval = self.settings.provider_outbox_seconds
        while not await pause(stop, interval):
            try:
                commands = await provider_outbox.due(self.pool, interval)
                unsent = await self.send(commands) if commands else []
                metrics.PROVIDER_OUTBOX.set(await provider_outbox.pending(self.pool))
            except Exception as exc:  # the relay outlives any one failure
                log.warning("relaying the provider outbox failed (will retry): %r", exc)
                continue
            if commands:
                log.info("relayed %d stored provider commands; %d not acknowledged yet",
                         len(commands), len(unsent))  # fmt: skip
