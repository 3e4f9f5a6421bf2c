"""A claim's time to live, env and providers, applied at the adoption (the pure rules,
projections/lifecycle/claims.py and providers.py): the expiry counted from the adoption, the env
merged into the spec, the providers attached; a rotation or detach of a provider only the claim
attached restarts nothing while the adopted generation runs, and restarts as usual after."""

from __future__ import annotations

from datetime import timedelta
from uuid import uuid4

import factories as f

from events.common import Phase as P
from events.common import SandboxSpec
from events.decided import AgentRestarted, AgentRestartSkipped, SandboxAdopted, SandboxExpired
from projections.credentials import plan

MEMBER = "pool-a1b2c3d4"
ENV = SandboxSpec(image=f.IMAGE, env={"MODE": "template", "KEEP": "1"})


def ready_member(providers: tuple[str, ...] = ()) -> f.Harness:
    h = f.Harness()
    h.send(f.create(MEMBER, sandbox_spec=ENV, pool="pool", providers=providers))
    h.send(f.running(MEMBER, occurred_at=f.at(1)))
    assert h.row(MEMBER).phase is P.READY and h.row(MEMBER).expires_at is None
    return h


def test_a_claims_ttl_counts_from_the_adoption_and_the_member_then_expires_by_it() -> None:
    h = ready_member()
    h.send(f.adopt(MEMBER, "mine", "c1", ttl_seconds=30, occurred_at=f.at(100)))
    row = h.row(MEMBER)
    assert row.expires_at == f.at(100) + timedelta(seconds=30)
    assert h.rebuilt()[MEMBER] == row  # replay from the decided events agrees
    assert row.expires_at is not None
    d = h.send(f.due(MEMBER, "ttl", row.expires_at, occurred_at=f.at(131)))
    assert d.disposition == "applied", d.reason
    assert any(isinstance(e, SandboxExpired) for e in d.events)
    assert h.row(MEMBER).phase is P.STOPPING  # the template's on_expiry (stop)


def test_a_claim_without_a_ttl_leaves_the_member_untimed() -> None:
    h = ready_member()
    h.send(f.adopt(MEMBER, "mine", "c1", occurred_at=f.at(100)))
    assert h.row(MEMBER).expires_at is None
    (adopted,) = [e for e in h.events(MEMBER) if isinstance(e, SandboxAdopted)]
    assert "expires_at" not in adopted.model_dump(mode="json")  # serialized as before


def test_a_retried_adoption_keeps_the_first_expiry() -> None:
    h = ready_member()
    h.send(f.adopt(MEMBER, "mine", "c1", ttl_seconds=30, occurred_at=f.at(100)))
    d = h.send(f.adopt(MEMBER, "mine", "c1", ttl_seconds=30, occurred_at=f.at(200)))
    assert d.disposition == "idempotent"
    assert h.row(MEMBER).expires_at == f.at(130)


def test_a_claims_env_and_providers_merge_into_the_row_as_a_templates_overrides_do() -> None:
    h = ready_member(providers=("tpl",))
    h.send(
        f.adopt(
            MEMBER, "mine", "c1", env={"MODE": "claim", "NEW": "x"}, providers=["gh", "tpl"],
            labels={"team": "a"}, occurred_at=f.at(2),
        )
    )  # fmt: skip
    row = h.row(MEMBER)
    assert row.spec.env == {"MODE": "claim", "KEEP": "1", "NEW": "x"}
    assert row.spec.labels == {"team": "a"}
    assert row.providers == ("gh", "tpl")
    # Only what the claim attached is the claim's: the template's provider the process read.
    assert (row.claim_providers, row.adopted_generation) == (("gh",), 1)
    assert row.generation == 1  # no restart
    assert h.rebuilt()[MEMBER] == row


def test_rotating_a_provider_only_the_claim_attached_restarts_nothing() -> None:
    h = ready_member(providers=("tpl",))
    h.send(f.adopt(MEMBER, "mine", "c1", providers=["gh"], occurred_at=f.at(2)))
    row = h.row(MEMBER)
    (line,) = plan({"gh": 2}, [row], True, {"gh": uuid4()})
    assert line.action == "skip" and "attached at its claim" in line.reason  # the receipt
    d = h.send(f.rotate(MEMBER, {"gh": 2}, occurred_at=f.at(3)))
    (skipped,) = d.events
    assert isinstance(skipped, AgentRestartSkipped) and "never read it" in skipped.reason
    assert h.row(MEMBER).phase is P.READY and h.row(MEMBER).generation == 1


def test_rotating_a_template_provider_of_an_adopted_member_restarts_it() -> None:
    h = ready_member(providers=("tpl",))
    h.send(f.adopt(MEMBER, "mine", "c1", providers=["gh"], occurred_at=f.at(2)))
    d = h.send(f.rotate(MEMBER, {"tpl": 2, "gh": 2}, occurred_at=f.at(3)))
    assert [type(e) for e in d.events] == [AgentRestarted]


def test_after_its_next_start_the_process_holds_the_claims_providers_and_a_rotation_restarts() -> (
    None
):
    h = ready_member()
    h.send(f.adopt(MEMBER, "mine", "c1", providers=["gh"], occurred_at=f.at(2)))
    h.send(f.restart(MEMBER, occurred_at=f.at(3)), f.running(MEMBER, 2, occurred_at=f.at(4)))
    assert h.row(MEMBER).phase is P.READY and h.row(MEMBER).generation == 2
    d = h.send(f.rotate(MEMBER, {"gh": 3}, occurred_at=f.at(5)))
    assert [type(e) for e in d.events] == [AgentRestarted]


def test_detaching_a_provider_only_the_claim_attached_restarts_nothing() -> None:
    h = ready_member()
    h.send(f.adopt(MEMBER, "mine", "c1", providers=["gh"], occurred_at=f.at(2)))
    d = h.send(f.detach(MEMBER, provider="gh", occurred_at=f.at(3)))
    assert d.disposition == "applied" and "execs no longer get its values" in d.reason
    row = h.row(MEMBER)
    assert (row.providers, row.claim_providers, row.generation) == ((), (), 1)
