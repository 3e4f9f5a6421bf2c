"""Providers and a running agent: what a credential rotation (``ROTATION_TABLE``) and a
detach (``DETACH_TABLE``) do to a sandbox in each phase, and which launches read values that
are stale since.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from events.common import Phase

from .model import P, Sandbox, is_held

# Credential rotation (RotateCredentials): what a rotation of attached providers does to a
# sandbox in each phase. RESTART starts a new generation once for all the providers the command
# names (AgentRestarted, a launch intent that reads the current values); any other entry is the
# reason recorded with AgentRestartSkipped (the new values apply at the next start). A command
# naming only providers the sandbox has not attached changes nothing (idempotent).
#
# RESTART_PENDING (Provisioning, Starting): a launch of the current generation is pending and
# reads the values when it runs, which may be before or after this rotation was stored. The
# rotation is recorded in the row (``awaited``); the launch's report names the revisions it read
# (DriverOperationResult.credentials), and only if one is older than awaited (or unknown) does
# the sandbox restart again, at once (SandboxReady + AgentRestarted on that report). A running
# snapshot does not make it Ready meanwhile: Ready means running the newest values.
# Detaching a provider (DetachProvider): what losing a provider does to a sandbox in each phase
# that admits the command (COMMAND_TABLE). The agent must stop seeing the provider's values,
# as after a rotation: RESTART records ProviderDetached and AgentRestarted (``detached``) in
# one decision, a new generation whose launch reads only the providers still attached; any
# other entry is why it does not restart (the outcome's message), the values leaving at its
# next start.
#
# DETACH_PENDING (Provisioning, Starting): the pending launch reads the attached providers when
# it runs, which may be before or after the detach. The detached provider is recorded in the
# row (``awaited``, revision 0: "must not have been read"); if the launch's report names it
# (or is unknown), the sandbox restarts once more, at once, without it.


RESTART: Final = "restart"


# The phases whose generation may still be running, or be seen running again, on values older
# than a rotation (or with a provider detached) decided in them: a pending launch (it may have
# read before) and Error (a running snapshot lifts it to Ready). Stopping never leads back to
# Ready (a decided stop is never undone). A rotation or detach that the table defers in these
# phases is recorded in the row (``awaited``); should that generation become Ready without a
# launch report that read the newest values, it restarts at once (AgentRestarted; skipped if
# held).
OWED_PHASES: Final = (P.PROVISIONING, P.STARTING, P.ERROR)


RESTART_PENDING: Final = "restart already pending: the pending launch reads the newest values"


ROTATION_TABLE: Final[dict[Phase, str]] = {
    P.PROVISIONING: RESTART_PENDING,
    P.STARTING: RESTART_PENDING,
    P.READY: RESTART,
    P.STOPPING: "stopping: the new values apply at its next start",
    P.STOPPED: "stopped: the new values apply at its next start",
    P.SUSPENDING: "suspending: the new values apply when it resumes",
    P.SUSPENDED: "suspended: the new values apply when it resumes",
    P.COMPLETED: "completed: the new values apply at its next start",
    P.ERROR: "in error: the new values apply at its next start (at once if it is seen running "
    "again)",
    P.DELETING: "being deleted",
}


NO_RESTART: Final = "restart not requested (no-restart): the new values apply at the next start"


HELD: Final = "held: the new values apply at its next start"


# The row's reason while a rotation restart is in flight; a failed launch then is an
# AgentRestartFailed rather than a plain SandboxFailed.
ROTATION_RESTART: Final = "restarting for rotated credentials: "


def held(state: Sandbox) -> bool:
    """Whether a hold keeps ``state`` from being restarted by a rotation (an operator's hold:
    the new values wait for the release and the next start)."""
    return is_held(state)


# A rotation or detach naming only providers a claim attached, while the generation adopted
# runs: its process never read them (they reach each exec, not the process), so there is
# nothing to restart; the next exec reads the new values (or none).
CLAIM_ROTATED: Final = (
    "attached at its claim: the running process never read it; the next exec reads the new values"
)
CLAIM_DETACHED: Final = (
    "attached at its claim: the running process never read it; execs no longer get its values"
)


def unread_by_process(state: Sandbox, providers: Iterable[str]) -> bool:
    """Whether ``providers`` (not none) were all attached by a claim after the running
    generation started (the adopted generation still runs), so its process never read them."""
    named = set(providers)
    return (
        bool(named)
        and state.adopted_generation == state.generation
        and named <= set(state.claim_providers)
    )


def rotation_action(state: Sandbox, restart: bool, providers: Iterable[str] = ()) -> str:
    """RESTART, or why not: the one rule for the processor and for an update's receipt
    (``providers``: the rotated ones the sandbox has attached)."""
    if state.phase is P.READY and unread_by_process(state, providers):
        return CLAIM_ROTATED
    return _restart_rule(state, restart, ROTATION_TABLE, NO_RESTART, HELD)


def _restart_rule(
    state: Sandbox, restart: bool, table: dict[Phase, str], not_asked: str, on_hold: str
) -> str:
    """RESTART or why not, by ``table`` unless no restart was asked for or a hold keeps it."""
    if not restart:
        return not_asked
    if held(state):
        return on_hold
    return table[state.phase]


def stale_rotations(state: Sandbox, read: dict[str, int] | None) -> dict[str, int]:
    """The awaited rotations of still attached providers that a launch which read ``read``
    (provider -> revision; None: unknown) did not see: the agent must restart for these."""
    return {
        p: r
        for p, r in state.awaited.items()
        if p in state.providers and (read is None or read.get(p, 0) < r)
    }


DETACH_PENDING: Final = "launch pending: it restarts once more if that launch read the provider"


DETACH_TABLE: Final[dict[Phase, str]] = {
    P.PROVISIONING: DETACH_PENDING,
    P.STARTING: DETACH_PENDING,
    P.READY: RESTART,
    P.STOPPING: "stopping: its next start runs without the provider's values",
    P.STOPPED: "stopped: its next start runs without the provider's values",
    P.SUSPENDING: "suspending: it resumes without the provider's values",
    P.SUSPENDED: "suspended: it resumes without the provider's values",
    P.COMPLETED: "completed: its next start runs without the provider's values",
    P.ERROR: "in error: its next start runs without the provider's values (it restarts at once "
    "if it is seen running again)",
}


DETACH_NO_RESTART: Final = (
    "restart not requested (no-restart): the provider's values leave at the next start"
)


DETACH_HELD: Final = "held: the provider's values leave at its next start"


# The row's reason while a restart that drops detached providers is in flight.
DETACH_RESTART: Final = "restarting without detached providers: "


def detach_action(state: Sandbox, restart: bool, provider: str | None = None) -> str:
    """RESTART, or why not: what detaching ``provider`` does to ``state``."""
    if state.phase is P.READY and provider is not None and unread_by_process(state, [provider]):
        return CLAIM_DETACHED
    return _restart_rule(state, restart, DETACH_TABLE, DETACH_NO_RESTART, DETACH_HELD)


def stale_detaches(state: Sandbox, read: dict[str, int] | None) -> list[str]:
    """The providers detached while a launch was pending that the launch which read ``read``
    did read (or may have: None, unknown): the agent must restart without these."""
    return sorted(
        p
        for p in state.awaited
        if p not in state.providers and (read is None or read.get(p, 0) > 0)
    )


def restart_reason(rotated: list[str], detached: list[str]) -> str:
    """The row's reason while a restart for rotated or detached providers is in flight."""
    parts = []
    if rotated:
        parts.append(ROTATION_RESTART + ", ".join(rotated))
    if detached:
        parts.append(DETACH_RESTART + ", ".join(detached))
    return "; ".join(parts)
