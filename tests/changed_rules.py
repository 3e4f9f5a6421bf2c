"""A deliberately changed rule for the audit tests: a stop of a Ready sandbox is refused.

``sandstream audit verify --rules changed_rules`` (with tests/ on the path) must find that
this would rewrite the recorded history, at the first stop of a Ready sandbox.
"""

from __future__ import annotations

from events.common import Cause, Phase
from projections.lifecycle import DEFAULT_LIMITS, Decision, Limits, Message, Sandbox
from projections.lifecycle import decide as todays_decide


def decide(
    state: Sandbox | None, message: Message, cause: Cause, limits: Limits = DEFAULT_LIMITS
) -> Decision:
    decision = todays_decide(state, message, cause, limits)
    if message.type == "StopSandbox" and state is not None and state.phase is Phase.READY:
        return Decision(state, (), "rejected", "stopping a Ready sandbox is not allowed", None)
    return decision
