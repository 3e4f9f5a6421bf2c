"""Which phase admits which command: ``COMMAND_TABLE`` (admit, idempotent, reject) and the
lookups ``decide`` makes on it.
"""

# The one-letter names A/I/R keep the transition table readable at a glance.
# ruff: noqa: E741

from __future__ import annotations

from enum import Enum
from typing import Final

from events.commands import Command, ResumeSandbox
from events.common import Phase

from .model import P, Sandbox, expired

# Commands: which phase admits what.
#   ADMIT       the command is accepted and changes the row (one event, version + 1)
#   IDEMPOTENT  accepted, the row already is what the command asks for: no event, no new version
#   REJECT      FAILED_PRECONDITION, with a message naming the current phase


class Admission(Enum):
    ADMIT = "admit"
    IDEMPOTENT = "idempotent"
    REJECT = "reject"


A, I, R = Admission.ADMIT, Admission.IDEMPOTENT, Admission.REJECT


PHASE_COLUMNS: Final = (
    P.PROVISIONING, P.STARTING, P.READY, P.STOPPING, P.STOPPED, P.SUSPENDING, P.SUSPENDED,
    P.COMPLETED, P.ERROR, P.DELETING,
)  # fmt: skip


# Suspend frees a sandbox's compute wherever a runtime of it may exist or run (a pending launch
# included: its runtime is removed once it is up); a stop under way finishes first. Resume is
# the start of a suspended sandbox (a start admits Suspended too); elsewhere it only confirms
# a sandbox that runs or is about to. A stop waits for a suspend under way (refused in
# Suspending, as a suspend is in Stopping): the suspend ends Suspended, where nothing runs and a
# stop has nothing to do, or, failed with the runtime running, Ready, where a stop is admitted.
COMMAND_TABLE: Final[dict[str, tuple[Admission, ...]]] = {
    # Provisioning, Starting, Ready, Stopping, Stopped, Suspending, Suspended, Completed, Error,
    # Deleting:
    #                   Prov Start Ready Stopg Stopd Suspg Suspd Compl Error Delg
    "StartSandbox":    (I,   I,    I,    R,    A,    R,    A,    A,    A,    R),
    "StopSandbox":     (A,   A,    A,    I,    I,    R,    I,    A,    A,    R),
    "RestartSandbox":  (A,   A,    A,    A,    A,    A,    A,    A,    A,    R),
    "SuspendSandbox":  (A,   A,    A,    R,    A,    I,    I,    A,    A,    R),
    "ResumeSandbox":   (I,   I,    I,    R,    R,    R,    A,    R,    R,    R),
    "DeleteSandbox":   (A,   A,    A,    A,    A,    A,    A,    A,    A,    I),
    "AttachProvider":  (A,   A,    A,    A,    A,    A,    A,    A,    A,    R),
    "DetachProvider":  (A,   A,    A,    A,    A,    A,    A,    A,    A,    R),
    "HoldSandbox":     (A,   A,    A,    A,    A,    A,    A,    A,    A,    R),
    "ReleaseSandbox":  (A,   A,    A,    A,    A,    A,    A,    A,    A,    R),
    "ExtendSandbox":   (A,   A,    A,    A,    A,    A,    A,    A,    A,    R),
    "SetRestartPolicy":(A,   A,    A,    A,    A,    A,    A,    A,    A,    R),
    "SetIdleSuspend":  (A,   A,    A,    A,    A,    A,    A,    A,    A,    R),
}  # fmt: skip


# A held sandbox refuses these (FAILED_PRECONDITION naming who holds it and why) in every
# phase; stop, suspend and delete stay admitted (they start nothing). Hold on a held and
# release on an unheld sandbox are idempotent.
REFUSED_WHILE_HELD: Final = ("StartSandbox", "RestartSandbox", "ResumeSandbox")


VERB = {
    "StartSandbox": "start",
    "StopSandbox": "stop",
    "RestartSandbox": "restart",
    "SuspendSandbox": "suspend",
    "ResumeSandbox": "resume",
    "DeleteSandbox": "delete",
    "AttachProvider": "attach a provider",
    "DetachProvider": "detach a provider",
    "HoldSandbox": "hold",
    "ReleaseSandbox": "release",
    "ExtendSandbox": "extend",
    "SetRestartPolicy": "set the restart policy",
    "SetIdleSuspend": "set the idle timeout",
}


def admission(command_type: str, phase: Phase) -> Admission:
    return COMMAND_TABLE[command_type][PHASE_COLUMNS.index(phase)]


def admitting_phases(command_type: str) -> list[Phase]:
    row = COMMAND_TABLE[command_type]
    return [p for p, a in zip(PHASE_COLUMNS, row, strict=True) if a is A]


def refusal(state: Sandbox, command: Command) -> str | None:
    """Why ``state`` refuses ``command`` with FAILED_PRECONDITION (None: it does not): its
    phase, a hold, or, for a wake's resume, a time to live that has ended."""
    verb = VERB[command.type]
    if admission(command.type, state.phase) is Admission.REJECT:
        allowed = ", ".join(p.value for p in admitting_phases(command.type))
        return f"sandbox must be {allowed} to {verb} (current phase: {state.phase})"
    if command.type in REFUSED_WHILE_HELD and state.hold is not None:
        hold = state.hold
        return (
            f"sandbox {command.key!r} is held by {hold.by} since {hold.since.isoformat()}: "
            f"{hold.reason} (release it to {verb})"
        )
    if (
        isinstance(command, ResumeSandbox)
        and command.wake
        and expired(state.reason, state.expires_at)
    ):
        # As a sandbox its expiry stopped, which no exec or files call starts.
        return (
            f"sandbox {command.key!r} is not woken: its time to live has ended "
            "(resume or start it, or extend it first)"
        )
    return None
