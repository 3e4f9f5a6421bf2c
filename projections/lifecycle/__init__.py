"""The lifecycle rules of a sandbox: one pure function ``decide(state, message, cause)``.

No I/O, no clock, no randomness: identities and timestamps come from the message and its log
coordinates, so replaying the same inputs in the same order yields the same events. ``evolve``
applies a decided event to a row; ``decide`` uses it, and so does the rebuild from the log.

The tables are the whole state machine (docs/state-machine.md shows the same):
``COMMAND_TABLE`` says which commands each phase admits, ``OBSERVATION_TABLE`` what each kind of
observation of the *current* generation does in each phase, ``PHASE_DEADLINES`` and
``DEADLINE_TABLE`` which phases carry a deadline and what its falling due does. Anything not in
the tables changes nothing and is recorded as ignored.

Time enters only through the log: a deadline is recorded in the row (computed from the
message's ``occurred_at`` and the ``Limits`` the processor is configured with), and only a
``DeadlineDue`` message naming exactly that deadline acts on it.

The modules import each other relatively, so a release's rules copied under another package
name (``sandstream audit verify --rules``, docs/audit.md) decide with their own modules.

Modules, each one job (the tables first):

- ``model``: the row (``Sandbox``), ``Limits``, ``Decision``.
- ``commands``: ``COMMAND_TABLE``, which phase admits which command.
- ``observations``: ``OBSERVATION_TABLE``, what an observation does in each phase.
- ``providers``: ``ROTATION_TABLE`` and ``DETACH_TABLE``, providers under a running agent.
- ``identity``: deterministic ids of sandboxes, generations and events.
- ``restarts``: the restart policy's tables and the rows its events change.
- ``rows``: ``evolve``, one decided event applied to a row.
- ``emit``: building decided events, outcomes, rejections.
- ``decisions``: ``decide``, the one entry.
- ``deadlines``: ``PHASE_DEADLINES``, when each deadline falls due.
- ``deadline_due``: ``DEADLINE_TABLE``, what a due deadline does; the completion policy.
- ``restart_policy``: whether an exit restarts; ``SetRestartPolicy``.
- ``idle``: ``IDLE_TABLE``, when a ``DeadlineDue(idle)`` suspends a sandbox nobody uses.
- ``claims``: a pool member adopted under a user's name, and the claim steps a decision sends.
"""

from __future__ import annotations

from .commands import (
    COMMAND_TABLE,
    PHASE_COLUMNS,
    REFUSED_WHILE_HELD,
    Admission,
    admission,
    admitting_phases,
)
from .deadline_due import DEADLINE_TABLE
from .deadlines import (
    EXIT_EVENTS,
    PHASE_DEADLINES,
    delete_deadline,
    grace_of,
    launch_deadline,
    stop_deadline,
)
from .decisions import decide
from .identity import (
    event_id_for,
    identity_for,
    next_generation,
    sandbox_id_for,
)
from .idle import IDLE_TABLE
from .model import (
    DEFAULT_LIMITS,
    DELETE_FAILED,
    EXPIRED,
    IDLE_SUSPEND,
    STOP_FAILED,
    Decision,
    Disposition,
    Limits,
    Message,
    Sandbox,
    awaits_delete_retry,
    awaits_stop_retry,
    expired,
    is_held,
)
from .observations import (
    FOLLOW_OBSERVED,
    KEEP_DELETING,
    KEEP_STOPPING,
    OBSERVATION_TABLE,
    ObservationKind,
    observation_kind,
)
from .providers import (
    CLAIM_DETACHED,
    CLAIM_ROTATED,
    DETACH_HELD,
    DETACH_NO_RESTART,
    DETACH_PENDING,
    DETACH_RESTART,
    DETACH_TABLE,
    HELD,
    NO_RESTART,
    OWED_PHASES,
    RESTART,
    RESTART_PENDING,
    ROTATION_TABLE,
    detach_action,
    rotation_action,
)
from .restarts import (
    DEFAULT_BACKOFF,
    EXIT_KINDS,
    PENDING_RESTART_TABLE,
    RESTART_LIMIT,
    RESTART_POLICY_TABLE,
    ExitKind,
    restart_delay,
    restarts_on,
)
from .rows import evolve

__all__ = [
    "CLAIM_DETACHED",
    "CLAIM_ROTATED",
    "COMMAND_TABLE",
    "DEADLINE_TABLE",
    "DEFAULT_BACKOFF",
    "DEFAULT_LIMITS",
    "DELETE_FAILED",
    "DETACH_HELD",
    "DETACH_NO_RESTART",
    "DETACH_PENDING",
    "DETACH_RESTART",
    "DETACH_TABLE",
    "EXIT_EVENTS",
    "EXIT_KINDS",
    "EXPIRED",
    "FOLLOW_OBSERVED",
    "HELD",
    "IDLE_SUSPEND",
    "IDLE_TABLE",
    "KEEP_DELETING",
    "KEEP_STOPPING",
    "NO_RESTART",
    "OBSERVATION_TABLE",
    "OWED_PHASES",
    "PENDING_RESTART_TABLE",
    "PHASE_COLUMNS",
    "PHASE_DEADLINES",
    "REFUSED_WHILE_HELD",
    "RESTART",
    "RESTART_LIMIT",
    "RESTART_PENDING",
    "RESTART_POLICY_TABLE",
    "ROTATION_TABLE",
    "STOP_FAILED",
    "Admission",
    "Decision",
    "Disposition",
    "ExitKind",
    "Limits",
    "Message",
    "ObservationKind",
    "Sandbox",
    "admission",
    "admitting_phases",
    "awaits_delete_retry",
    "awaits_stop_retry",
    "decide",
    "delete_deadline",
    "detach_action",
    "event_id_for",
    "evolve",
    "expired",
    "grace_of",
    "identity_for",
    "is_held",
    "launch_deadline",
    "next_generation",
    "observation_kind",
    "restart_delay",
    "restarts_on",
    "rotation_action",
    "sandbox_id_for",
    "stop_deadline",
]
