"""Sandboxes that need an operator's attention: past their deadline, held, or expiring soon,
counted in one query (``/v1/attention``, the ``/metrics`` gauges), and named, with why, a few
of each and those in Error (the console's attention list)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from pydantic import BaseModel, Field

from services.common.database import Pool


class Attention(BaseModel):
    as_of: datetime = Field(description="the API's clock when counted")
    past_deadline: int = Field(
        description="live sandboxes whose phase deadline or expiry has passed (not yet acted on)"
    )
    held: int
    expiring_soon: int = Field(description="expiring within expiring_within_seconds")
    expiring_within_seconds: float


async def attention(pool: Pool, now: datetime, soon_seconds: float) -> Attention:
    record = await pool.fetchrow(
        "SELECT count(*) FILTER (WHERE deadline_at <= $1 OR (expires_at <= $1 AND hold IS NULL))"
        " AS past_deadline, count(*) FILTER (WHERE hold IS NOT NULL) AS held, "
        "count(*) FILTER (WHERE expires_at > $1 AND expires_at <= $1 + $2::interval) "
        "AS expiring_soon FROM sandboxes WHERE phase <> 'Deleted'",
        now,
        timedelta(seconds=soon_seconds),
    )
    assert record is not None
    return Attention(
        as_of=now,
        past_deadline=record["past_deadline"],
        held=record["held"],
        expiring_soon=record["expiring_soon"],
        expiring_within_seconds=soon_seconds,
    )


ATTENTION_LIST: Final = 20  # sandboxes named per reason in the attention list
# One branch per reason, each a few rows by name; the same conditions as the counts above.
_COLUMNS: Final = "key, phase, deadline, deadline_at <= $1 AS overdue, expires_at, hold, reason"
_NEEDING: Final = f"""
(SELECT 'past_deadline' AS why, {_COLUMNS} FROM sandboxes
 WHERE phase <> 'Deleted' AND (deadline_at <= $1 OR (expires_at <= $1 AND hold IS NULL))
 ORDER BY key LIMIT $3)
UNION ALL
(SELECT 'held', {_COLUMNS} FROM sandboxes
 WHERE phase <> 'Deleted' AND hold IS NOT NULL ORDER BY key LIMIT $3)
UNION ALL
(SELECT 'expiring_soon', {_COLUMNS} FROM sandboxes
 WHERE phase <> 'Deleted' AND expires_at > $1 AND expires_at <= $1 + $2::interval
 ORDER BY key LIMIT $3)
UNION ALL
(SELECT 'error', {_COLUMNS} FROM sandboxes WHERE phase = 'Error' ORDER BY key LIMIT $3)
"""


@dataclass(frozen=True, slots=True)
class NeedsAttention:
    """One sandbox that needs attention, and why: past_deadline, held, expiring_soon or error."""

    why: str
    name: str
    phase: str
    detail: str  # in words: which deadline and when, who holds it and why, the error's reason


async def needing_attention(
    pool: Pool, now: datetime, soon_seconds: float, limit: int = ATTENTION_LIST
) -> list[NeedsAttention]:
    """Up to ``limit`` sandboxes by name for each reason (a sandbox may have several)."""
    records = await pool.fetch(_NEEDING, now, timedelta(seconds=soon_seconds), limit)
    return [NeedsAttention(r["why"], r["key"], r["phase"], _detail(r)) for r in records]


def _detail(r: Any) -> str:
    if r["why"] == "held":
        hold = json.loads(r["hold"])
        return f"held by {hold['by']}: {hold['reason']}"
    if r["why"] == "error":
        return r["reason"] or "no reason recorded"
    if r["why"] == "expiring_soon":
        return f"expires at {_shown(r['expires_at'])}"
    if r["overdue"]:
        deadline = json.loads(r["deadline"])
        return f"{deadline['kind']} deadline was due at {deadline['due_at']}"
    return f"expired at {_shown(r['expires_at'])}"


def _shown(moment: datetime) -> str:
    return moment.isoformat(timespec="seconds")
