"""The read side of the API and of the OpenShell door: queries on the PostgreSQL projection, and
nothing else. One module a job:

- ``views``: the answers (a sandbox's view, a list page, history entries, a command's status),
  built from records without I/O.
- ``pages``: page sizes, opaque page tokens bound to their query, label filters, and
  ``InvalidArgument`` naming the argument a query cannot use.
- ``queries``: a sandbox, the list (keyset pages on the name), a name's history, the input
  offsets the processor stored.
- ``outcomes``: a command's outcome, read once or awaited.
- ``horizon``: the one wait both feeds read up to: every value of their sequence below it is
  committed.
- ``changes``: the row change feed (``ChangeFeed``: LISTEN and a shared horizon query;
  ``changes_after``).
- ``versions``: every version of a sandbox's row, rebuilt from its decided events (the
  outbox) with the processor's ``evolve``.
- ``decided``: the feed of decided events from the outbox.
- ``counts``: the sandboxes that need an operator's attention (counted, and named with why).
- ``trend``: live sandboxes per phase now and over the last hours, from the history.

The names callers use are re-exported here (``from services.api.readmodel import SandboxView``,
``readmodel.list_sandboxes``): the package is the read model's interface, its modules are how
it is kept. Inside the package, modules import each other by module, never through here.
"""

from services.api.readmodel.changes import CHANGES_PAGE, ChangeFeed, changed_rows, changes_after
from services.api.readmodel.counts import Attention, NeedsAttention, attention, needing_attention
from services.api.readmodel.decided import (
    EVENTS_PAGE,
    Decided,
    events_after,
    retained_from,
)
from services.api.readmodel.horizon import change_horizon, current_horizon, event_horizon
from services.api.readmodel.outcomes import await_outcome, fetch_outcome, get_outcome
from services.api.readmodel.pages import (
    MAX_HISTORY_PAGE,
    MAX_PAGE,
    PAGE_TOKEN_MAX_LENGTH,
    InvalidArgument,
    decode_page_token,
    encode_page_token,
    parse_label_filters,
)
from services.api.readmodel.queries import (
    get_row,
    get_sandbox,
    history,
    list_sandboxes,
    recent_history,
    sandbox_exists,
    stored_input_offsets,
)
from services.api.readmodel.trend import (
    TREND_WINDOWS,
    Trend,
    TrendTooLarge,
    live_counts,
    phase_trend,
)
from services.api.readmodel.versions import (
    REPLAY_EVENTS,
    VersionsLost,
    incarnation_versions,
    versions_after,
)
from services.api.readmodel.views import (
    ClaimOutcome,
    CommandStatus,
    Condition,
    HistoryEntry,
    HistoryPage,
    Row,
    SandboxList,
    SandboxView,
    command_status,
    conditions,
    input_label,
    pending_status,
    sandbox_view,
    view_of,
)

__all__ = [
    "CHANGES_PAGE",
    "EVENTS_PAGE",
    "MAX_HISTORY_PAGE",
    "MAX_PAGE",
    "PAGE_TOKEN_MAX_LENGTH",
    "REPLAY_EVENTS",
    "TREND_WINDOWS",
    "Attention",
    "ChangeFeed",
    "ClaimOutcome",
    "CommandStatus",
    "Condition",
    "Decided",
    "HistoryEntry",
    "HistoryPage",
    "InvalidArgument",
    "NeedsAttention",
    "Row",
    "SandboxList",
    "SandboxView",
    "Trend",
    "TrendTooLarge",
    "VersionsLost",
    "attention",
    "await_outcome",
    "change_horizon",
    "changed_rows",
    "changes_after",
    "command_status",
    "conditions",
    "current_horizon",
    "decode_page_token",
    "encode_page_token",
    "event_horizon",
    "events_after",
    "fetch_outcome",
    "get_outcome",
    "get_row",
    "get_sandbox",
    "history",
    "incarnation_versions",
    "input_label",
    "list_sandboxes",
    "live_counts",
    "needing_attention",
    "parse_label_filters",
    "pending_status",
    "phase_trend",
    "recent_history",
    "retained_from",
    "sandbox_exists",
    "sandbox_view",
    "stored_input_offsets",
    "versions_after",
    "view_of",
]
