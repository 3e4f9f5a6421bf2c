"""The row change feed (``/v1/watch``, OpenShell's WatchSandbox): ``ChangeFeed`` wakes watchers
on the processor's NOTIFY and shares their horizon query; ``changes_after`` reads the rows."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Final, TypedDict, Unpack
from uuid import UUID

from events.topics import CHANGES_CHANNEL
from services.api.readmodel.horizon import current_horizon
from services.api.readmodel.views import VIEW_COLUMNS, Row, SandboxView, row_of
from services.common.database import Pool
from services.common.names import KEY_OF
from services.common.notify_channels import Listening
from services.common.shared_errors import own_copy


class ChangeFeed:
    """Wakes watchers when the processor commits (LISTEN), with a slow poll as a safety net."""

    def __init__(self, pool: Pool, poll_interval: float = 1.0) -> None:
        self.pool = pool
        self.poll_interval = poll_interval
        self._changed = asyncio.Event()
        self._closed = asyncio.Event()
        self._listening = Listening(pool, CHANGES_CHANNEL, self._notify, "change feed")
        # The horizon query in flight, and the mark that was current when it began.
        self._horizon: asyncio.Future[int | None] | None = None
        self._horizon_mark: asyncio.Event | None = None

    async def start(self) -> None:
        self._listening.start()

    async def close(self) -> None:
        self._closed.set()
        self._changed.set()
        await self._listening.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def mark(self) -> asyncio.Event:
        """Take before reading; ``wait(mark)`` then returns on any later change."""
        return self._changed

    async def horizon(self, mark: asyncio.Event) -> int | None:
        """The change horizon (``change_horizon``) as of ``mark`` or later.

        Watchers woken by one change share one query: a query in flight is reused if it began
        while ``mark`` was the current mark, hence after every change notified before it.
        """
        if self._horizon is None or self._horizon.done() or self._horizon_mark is not mark:
            self._horizon_mark = mark
            self._horizon = asyncio.ensure_future(current_horizon(self.pool))
            # Its error reaches the watchers awaiting it; none left is not an unhandled error.
            self._horizon.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            return await asyncio.shield(self._horizon)  # one watcher leaving cancels nothing
        except Exception as exc:  # one error object shared by every watcher awaiting it
            mine = own_copy(exc)
            if mine is exc:  # not copyable: shared, as before
                raise
            raise mine from exc

    async def wait(self, mark: asyncio.Event, timeout: float | None = None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(mark.wait(), timeout or self.poll_interval)

    def _notify(self, *_: object) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


CHANGES_PAGE: Final = 500  # rows per read of the change feed


# A bound name's row (a tombstone pointing at its adopted member) is no change of a sandbox:
# the member's own row is.
_CHANGE_FILTERS: Final = (
    "change_seq > $1 AND change_seq <= $2 AND (NOT $4 OR phase <> 'Deleted') "
    "AND bound_to IS NULL "
    "AND ($6::uuid IS NULL OR sandbox_id = $6) AND ($7::int IS NULL OR generation = $7)"
)
CHANGES: Final = (
    f"SELECT {VIEW_COLUMNS} FROM sandboxes WHERE {_CHANGE_FILTERS} "
    "AND (cardinality($3::text[]) = 0 OR key = ANY($3::text[])) ORDER BY change_seq LIMIT $5"
)
# Named rows are probed by key, one per name: a plan made generic (on empty tables) walked the
# change_seq index from the cursor, i.e. every row changed since, for a stream of one name.
# OFFSET 0 keeps the probe a probe (not flattened into a join the planner may make a scan). A
# name bound to an adopted pool member is probed as that member, as of each read.
CHANGES_OF_NAMES: Final = (
    f"SELECT {VIEW_COLUMNS} FROM (SELECT DISTINCT name FROM unnest($3::text[]) AS name) AS n "
    f"CROSS JOIN LATERAL (SELECT * FROM sandboxes WHERE key = {KEY_OF.format('n.name')} "
    "OFFSET 0) AS s "
    f"WHERE {_CHANGE_FILTERS} ORDER BY change_seq LIMIT $5"
)


async def changed_rows(
    pool: Pool,
    cursor: int,
    horizon: int,
    *,
    names: Sequence[str] = (),
    live_only: bool = False,
    limit: int = CHANGES_PAGE,
    incarnation: UUID | None = None,
    generation: int | None = None,
) -> list[Row]:
    """Rows changed after ``cursor`` up to ``horizon``, in change order (optionally only one
    incarnation's, or only while at one generation)."""
    records = await pool.fetch(
        CHANGES_OF_NAMES if names else CHANGES,
        cursor,
        horizon,
        list(names),
        live_only,
        limit,
        incarnation,
        generation,
    )
    return [row_of(r) for r in records]


class Narrowed(TypedDict, total=False):
    names: Sequence[str]
    live_only: bool
    limit: int
    incarnation: UUID | None
    generation: int | None


async def changes_after(
    pool: Pool, cursor: int, horizon: int, **narrowed: Unpack[Narrowed]
) -> list[SandboxView]:
    """``changed_rows`` as the API shows them."""
    return [row.view for row in await changed_rows(pool, cursor, horizon, **narrowed)]
