"""Which of the revisions a pool's members run a claim may adopt (services/api/pool_claims.vetted,
pure): the checks a create makes of its spec, made of each revision, and the time to live each
adoption sets. The runs on the real stack are in tests/test_pools.py."""

from __future__ import annotations

from datetime import UTC, datetime

from events.common import SandboxSpec
from services.api.pool_claims import Caller, vetted
from services.common.templates import Overrides, TemplateBody, TemplateInfo
from services.common.tokens import PROVIDER_WRITE, WRITE, Principal

AT = datetime(2026, 12, 7, tzinfo=UTC)


def revision(number: int, **body: object) -> TemplateInfo:
    spec = SandboxSpec.model_validate({"image": "x", **body.pop("spec", {})})  # type: ignore[dict-item]
    return TemplateInfo("t", number, TemplateBody(spec=spec, **body), AT, AT, "a", "a")  # type: ignore[arg-type]


def caller(*scopes: str, cap: int = 600, unsuspendable: str | None = None) -> Caller:
    principal = Principal("writer", frozenset({WRITE, *scopes}))
    return Caller(principal, cap, 3600, unsuspendable)


FOUND = [
    revision(1, providers=["gh"], ttl_seconds=60),
    revision(2, spec={"stop_timeout_seconds": 900}),
    revision(3, spec={"labels": {"team": "a"}, "idle_suspend_seconds": 300}),
    revision(4, ttl_seconds=120),
]


def test_each_revision_is_vetted_as_a_create_from_it_would_be() -> None:
    allowed, refused = vetted(FOUND, Overrides(), caller(), None)
    assert allowed == {3: 3600, 4: 120}
    assert refused == [
        "revision 1: it attaches providers (gh), which needs provider:write",
        "revision 2: its stop_timeout_seconds: at most 600 seconds for token 'writer' "
        "(asked for 900)",
    ]
    allowed, _ = vetted(FOUND, Overrides(ttl_seconds=30), caller(PROVIDER_WRITE, cap=900), None)
    assert allowed == {1: 30, 2: 30, 3: 30, 4: 30}  # the claim's own TTL wins


def test_a_label_override_or_an_unsuspendable_name_refuses_a_revision_and_pinned_is_alone() -> None:
    allowed, refused = vetted(FOUND, Overrides(labels={"team": "b"}), caller(), None)
    assert 3 not in allowed and "revision 3: field 'overrides.labels.team'" in refused[-1]
    allowed, refused = vetted(FOUND, Overrides(), caller(unsuspendable="no storage"), None)
    assert 3 not in allowed and refused[-1].startswith("revision 3: its idle timeout")
    assert vetted(FOUND, Overrides(), caller(), 4) == ({4: 120}, [])
    assert vetted(FOUND, Overrides(), caller(), 1)[0] == {}
