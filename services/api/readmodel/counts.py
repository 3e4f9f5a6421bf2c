"""Sandboxes that need an operator's attention (``/v1/attention``, the ``/metrics`` gauges): past
their deadline, held, or expiring soon, counted in one query."""

from __future__ import annotations

from datetime import datetime, timedelta

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
