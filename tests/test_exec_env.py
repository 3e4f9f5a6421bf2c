"""An exec's environment in a pool member (services/common/exec_env.py): the claim's env comes
with the row the door read to find the sandbox, so an exec in a member adopted without
providers reads nothing more; the providers' values are read at the exec only when the claim
attached some. The rows here come from the pure fold (tests/factories.py); the database is a
stand-in that fails any use, so a read it should not make is an error."""

from __future__ import annotations

from typing import Any

import factories as f
import pytest

from events.common import SandboxSpec
from services.api.readmodel.views import view_of
from services.common.credentials import Vault
from services.common.exec_env import ClaimPart, claim_part, exec_environment

MEMBER = "pool-a1b2c3d4"
SPEC = SandboxSpec(image=f.IMAGE, env={"MODE": "template", "KEEP": "1"})


class NoDatabase:
    """A pool any use of which fails the test."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the exec's env read PostgreSQL ({name})")


async def no_vault() -> Vault:
    raise AssertionError("the exec's env opened the vault")


def member(pool: str | None = "pool") -> f.Harness:
    h = f.Harness()
    h.send(f.create(MEMBER, sandbox_spec=SPEC, pool=pool))
    h.send(f.running(MEMBER, occurred_at=f.at(1)))
    return h


async def test_a_sandbox_no_claim_adopted_gets_the_requests_variables_alone() -> None:
    for h in (member(), member(pool=None)):
        row = h.row(MEMBER)
        assert claim_part(row) is None
        env = await exec_environment(NoDatabase(), no_vault, MEMBER, claim_part(row), {"A": "1"})  # type: ignore[arg-type]
        assert env == {"A": "1"}


async def test_a_claims_env_comes_from_the_row_read_with_no_read_of_its_own() -> None:
    h = member()
    h.send(f.adopt(MEMBER, "mine", "c1", env={"CLAIM": "x", "KEEP": "claim"}, occurred_at=f.at(2)))
    claim = view_of(h.row(MEMBER), 1).claim_part
    assert claim == ClaimPart({"MODE": "template", "KEEP": "claim", "CLAIM": "x"}, ())
    env = await exec_environment(NoDatabase(), no_vault, MEMBER, claim, {"KEEP": "asked"})  # type: ignore[arg-type]
    assert env == {"MODE": "template", "KEEP": "asked", "CLAIM": "x"}  # the request's win


async def test_a_claims_providers_values_are_read_at_the_exec() -> None:
    h = member()
    h.send(f.adopt(MEMBER, "mine", "c1", providers=["gh"], occurred_at=f.at(2)))
    claim = view_of(h.row(MEMBER), 1).claim_part
    assert claim is not None and claim.providers == ("gh",)
    with pytest.raises(AssertionError, match="read PostgreSQL"):
        await exec_environment(NoDatabase(), no_vault, MEMBER, claim, {})  # type: ignore[arg-type]


def test_the_claims_part_is_never_in_an_answer() -> None:
    h = member()
    h.send(f.adopt(MEMBER, "mine", "c1", env={"CLAIM": "x"}, occurred_at=f.at(2)))
    view = view_of(h.row(MEMBER), 1)
    assert view.claim_part is not None
    answer = view.model_dump()
    assert "claim_part" not in answer and "CLAIM" in view.model_dump_json()  # in the spec only
    assert answer["claim_providers"] == []  # the public part: the providers' names
    assert "_claim" not in view.model_json_schema()["properties"]
