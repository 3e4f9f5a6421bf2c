"""OpenShell's provider messages <-> sandstream's providers: pure functions, no I/O.

A provider answers with its key names and empty values (values are write-only: they go into
PostgreSQL encrypted and never come back out), its type, its incarnation as ``metadata.id`` and
its revision as ``metadata.resource_version``. Requests are checked with the HTTP API's own
models (``services/api/routes/providers.py``), so both doors accept the same names, types and
keys. What sandstream does not keep (``config``, credential expiration times, credential
handles) is refused by name rather than dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from pydantic import ValidationError

from services.api.providers import Receipt
from services.api.routes.providers import ProviderValues
from services.common.providers import RESERVED_PREFIX, ProviderInfo
from services.openshell import mapping
from services.openshell.proto import served_pb2

DEFAULT_PAGE: Final = 100  # providers per answer when the client asks for no page size
MAX_PAGE: Final = 500
Strategy = served_pb2.ProviderCredentialRefreshStrategy
STATIC: Final = Strategy.PROVIDER_CREDENTIAL_REFRESH_STRATEGY_STATIC
UPDATE: Final = served_pb2.PROVIDER_MUTATION_KIND_UPDATE


def strategy_name(value: int) -> str:
    """``OAUTH2_REFRESH_TOKEN`` for its enum value (as OpenShell's CLI names it)."""
    try:
        name = Strategy.Name(value)  # type: ignore[arg-type]
    except ValueError:
        return str(value)
    return name.removeprefix("PROVIDER_CREDENTIAL_REFRESH_STRATEGY_")


def provider_message(info: ProviderInfo) -> served_pb2.Provider:
    meta = mapping.object_meta(info.name, str(info.incarnation), info.created_at, info.revision, {})
    return served_pb2.Provider(
        metadata=meta, type=info.type, credentials={k.name: "" for k in info.keys}
    )


@dataclass(frozen=True, slots=True)
class ProviderInput:
    name: str
    type: str | None
    credentials: dict[str, str]


# The fields of either generation's Provider that sandstream does not keep.
UNKEPT: Final = (
    "config",
    "credential_expires_at_ms",  # 0.0
    "credential_expiration_times",  # 0.1
    "credential_handles",
)


def provider_input(provider: Any, *, unkept_in_request: Sequence[str] = ()) -> ProviderInput:
    """The provider of a Create or Update request (either generation), checked as the HTTP
    API checks it; InvalidRequest naming the field."""
    given = {d.name for d, _ in provider.ListFields()}
    unkept = [f"provider.{f}" for f in UNKEPT if f in given] + list(unkept_in_request)
    if unkept:
        raise mapping.InvalidRequest(f"{unkept[0]}: not supported by sandstream")
    name = provider.metadata.name
    try:
        checked = ProviderValues(
            name=name, type=provider.type or None, credentials=dict(provider.credentials)
        )
    except ValidationError as exc:
        where = {"name": "provider.metadata.name", "type": "provider.type"}
        parts = []
        for item in exc.errors()[:3]:
            loc = [str(p) for p in item["loc"]]
            field = where.get(loc[0], "provider." + ".".join(loc))
            parts.append(f"{field}: {item['msg']}")
        raise mapping.InvalidRequest("; ".join(parts)) from None
    reserved = sorted(k for k in checked.credentials if k.startswith(RESERVED_PREFIX))
    if reserved:
        raise mapping.InvalidRequest(
            f"provider.credentials: {', '.join(reserved)}: names starting with "
            f"{RESERVED_PREFIX} are reserved"
        )
    return ProviderInput(checked.name, checked.type, dict(checked.credentials))


def target_receipts(
    receipt: Receipt, mutation_id: str, at: datetime
) -> list[served_pb2.ProviderMutationReceipt]:
    """One receipt per attached live sandbox and rotated provider of an update: its restart
    command's id as ``receipt_id`` (a skipped restart is a receipt too: recorded, not run)."""
    revisions = {a.change.provider: a.revision for a in receipt.applied}
    return [
        served_pb2.ProviderMutationReceipt(
            receipt_id=line.command_id,
            mutation_id=mutation_id,
            provider=provider,
            workspace=mapping.DEFAULT_WORKSPACE,
            kind=UPDATE,
            desired=served_pb2.ProviderDesiredIdentity(
                sandbox=line.sandbox,
                provider_resource_version=revisions[provider],
                provider_env_revision=revisions[provider],
            ),
            persisted_time=mapping.timestamp(at),
        )
        for line in receipt.sandboxes
        for provider in line.providers
    ]


def refresh_status(
    info: ProviderInfo, key: str, status: str, at: datetime
) -> served_pb2.ProviderCredentialRefreshStatus:
    return served_pb2.ProviderCredentialRefreshStatus(
        provider=info.name,
        provider_id=str(info.incarnation),
        credential_key=key,
        strategy=STATIC,
        status=status,
        last_refresh_at_ms=mapping.millis(at),
        last_refresh_time=mapping.timestamp(at),
    )


@dataclass(frozen=True, slots=True)
class Page:
    items: list[ProviderInfo]
    next_page_token: str


def page(found: list[ProviderInfo], *, size: int, token: str = "", skip: int = 0) -> Page:
    """A page of providers sorted by name: after ``token`` (the last name of the page before,
    0.1) or ``skip`` of them (0.0's offset)."""
    if size < 0:
        raise mapping.InvalidRequest("page_size: negative")
    after = sorted((i for i in found if i.name > token), key=lambda i: i.name)[skip:]
    size = min(size or DEFAULT_PAGE, MAX_PAGE)
    items = after[:size]
    return Page(items, items[-1].name if len(after) > size else "")
