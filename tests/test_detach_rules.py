"""The detach rule of the pure core (``projections.lifecycle.DETACH_TABLE``): a sandbox that
loses a provider must stop running its values.

A Ready sandbox restarts without it (ProviderDetached + AgentRestarted in one decision) unless
the detach asks for no restart or the sandbox is held; Stopping, Stopped, Completed and Error
are left alone (their next start runs without it); a sandbox whose launch is pending restarts
once more only if that launch read the provider. A property test drives detaches, attaches,
launch reads and reports in any order: the agent ends on no detached provider's values and
restarts exactly when it must.
"""

from __future__ import annotations

import factories as f
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.codec import COMMANDS, decode, encode
from events.common import Phase
from events.decided import AgentRestarted, AgentRestartFailed, ProviderDetached
from projections.lifecycle import (
    DETACH_HELD,
    DETACH_NO_RESTART,
    DETACH_PENDING,
    DETACH_RESTART,
    DETACH_TABLE,
    RESTART,
    admitting_phases,
)

P = Phase
PENDING = {P.PROVISIONING, P.STARTING}


def test_the_detach_table_restarts_ready_and_defers_to_a_pending_launch() -> None:
    assert set(DETACH_TABLE) == set(admitting_phases("DetachProvider"))
    assert {p for p, action in DETACH_TABLE.items() if action == RESTART} == {P.READY}
    assert {p for p, action in DETACH_TABLE.items() if action == DETACH_PENDING} == PENDING


@pytest.mark.parametrize("phase", list(DETACH_TABLE), ids=lambda p: p.value)
def test_a_detach_in_each_phase(phase: Phase) -> None:
    h = f.harness_in(phase, providers=["p", "q"])
    before = h.row()
    decision = h.send(f.detach(provider="p"))
    assert decision.outcome is not None and decision.outcome.accepted
    assert h.row().providers == ("q",)
    assert isinstance(decision.events[0], ProviderDetached)
    if DETACH_TABLE[phase] == RESTART:
        restarted = decision.events[1]
        assert isinstance(restarted, AgentRestarted)
        assert (restarted.detached, restarted.providers) == (["p"], [])
        assert restarted.previous_generation == before.generation
        row = h.row()
        assert (row.phase, row.generation) == (P.STARTING, before.generation + 1)
        assert row.identity != before.identity and row.reason == DETACH_RESTART + "p"
    else:
        assert len(decision.events) == 1
        assert (h.row().phase, h.row().generation) == (phase, before.generation)
        assert DETACH_TABLE[phase] in decision.outcome.message
    assert h.rebuilt()[f.KEY] == h.row()


def test_no_restart_and_a_hold_leave_a_ready_sandbox_running() -> None:
    h = f.harness_in(P.READY, providers=["p", "q"])
    decision = h.send(f.detach(provider="p", restart=False))
    assert decision.outcome is not None and DETACH_NO_RESTART in decision.outcome.message
    h.send(f.hold())
    decision = h.send(f.detach(provider="q"))
    assert decision.outcome is not None and DETACH_HELD in decision.outcome.message
    assert [type(e) for e in decision.events] == [ProviderDetached]
    assert (h.row().phase, h.row().generation, h.row().providers) == (P.READY, 1, ())


def test_a_failed_launch_of_a_detach_restart_is_agent_restart_failed() -> None:
    h = f.harness_in(P.READY, providers=["p"])
    h.send(f.detach(provider="p"))
    (event,) = h.send(f.failed(f.KEY, 2, "launch")).events
    assert isinstance(event, AgentRestartFailed)
    assert h.row().phase is P.ERROR


@pytest.mark.parametrize(
    ("read", "restarts"),
    [({"p": 1, "q": 1}, True), ({"q": 1}, False), (None, True)],
    ids=["read-it", "read-after-the-detach", "unknown"],
)
def test_a_detach_while_the_launch_is_pending_restarts_only_if_the_launch_read_it(
    read: dict[str, int] | None, restarts: bool
) -> None:
    h = f.harness_in(P.STARTING, providers=["p", "q"])  # the start of generation 2 is pending
    h.send(f.detach(provider="p"))
    assert h.row().awaited == {"p": 0}
    assert h.send(f.running(f.KEY, 2)).disposition == "ignored"  # waits for the report
    decision = h.send(f.launched(f.KEY, 2, credentials=read))
    if restarts:
        assert [e.type for e in decision.events] == ["SandboxReady", "AgentRestarted"]
        again = decision.events[1]
        assert isinstance(again, AgentRestarted) and again.detached == ["p"]
        assert (h.row().phase, h.row().generation) == (P.STARTING, 3)
    else:
        assert [e.type for e in decision.events] == ["SandboxReady"]
        assert (h.row().phase, h.row().generation) == (P.READY, 2)
    assert h.row().awaited == {}
    assert h.rebuilt()[f.KEY] == h.row()


def test_the_detach_command_round_trips_through_the_codec() -> None:
    for restart in (True, False):
        command = f.detach(provider="p", restart=restart)
        assert decode(COMMANDS, encode(command)) == command


# One sandbox, Ready at first with some of p, q, r attached. Steps detach or attach a provider
# (the API's commands), or let the pending launch read the attached providers, or report.
Step = tuple[str, str]
steps = st.lists(
    st.tuples(st.sampled_from(["detach", "attach", "read", "report"]), st.sampled_from("pqr")),
    max_size=16,
)


@settings(max_examples=300, deadline=None)
@given(script=steps, attached=st.sets(st.sampled_from("pqr")))
def test_the_agent_never_keeps_a_detached_providers_values(
    script: list[Step], attached: set[str]
) -> None:
    h = f.harness_in(P.READY, providers=sorted(attached))
    running = set(attached)  # what the running agent read
    launch: set[str] | None = None  # what the pending launch read (None: not yet)
    pending = False
    expected = 0

    def decided(events: tuple[object, ...]) -> None:
        nonlocal pending, launch
        if any(isinstance(e, AgentRestarted) for e in events):
            pending, launch = True, None

    for kind, provider in script + [("read", ""), ("report", "")] * 3:
        now = set(h.row().providers)
        if kind == "detach":
            if provider in now and not pending:
                expected += 1  # Ready: the agent runs its values
            decided(h.send(f.detach(provider=provider)).events)
        elif kind == "attach":
            decided(h.send(f.attach(provider=provider)).events)  # applies at the next start
        elif kind == "read" and pending and launch is None:
            launch = now
        elif kind == "report" and pending and launch is not None:
            if launch - now:
                expected += 1  # it read a provider detached while it was pending
            else:
                running = launch
            pending = False
            credentials = {p: 1 for p in launch}
            decided(h.send(f.launched(f.KEY, h.row().generation, credentials=credentials)).events)

    restarts = [e for e in h.events(f.KEY) if isinstance(e, AgentRestarted)]
    assert len(restarts) == expected
    assert h.row().phase is P.READY and not pending and h.row().awaited == {}
    assert running <= set(h.row().providers)  # no detached provider's values
    assert h.rebuilt() == {k: v for k, v in h.states.items() if v is not None}
