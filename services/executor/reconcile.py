"""The reconcile loop: compares the driver's listing with the phase rows and reports the
differences as observations.

It reports a runtime that vanished behind sandstream's back (``RuntimeRemoved``, which moves a
Ready row to Error and a Stopping one to Stopped), an orphan runtime carrying our marker but
no live row, and a runtime of a Stopped row's own generation that runs (both snapshots the
processor records as ignored). It never stops, removes or starts anything itself: the
processor decides.

Two exceptions are handed to the executor, because no event will ever ask for them: a runtime
of an older generation than its row's still running while the row is not launching (the
launch or stop that should have stopped it was lost with an executor that died, or was
decided before a new executor group joined), and a runtime of the current generation running
under a Stopped row (started behind sandstream's back, or its stop was lost): Scenario 5 the
other way round. An executor process's pass passes them to ``stop_stale`` and ``stop_stray``
(``Executor.stop_stale``, ``Executor.stop_stray``), which stop them if the sandbox's
partition is its own.

A third is a deleted incarnation's leftovers: what the backend still holds of an incarnation
(its runtimes, workspace volume or claim, labelled secrets: ``HoldingsDriver.incarnations``)
that this store tombstoned (the row's tombstone, or a history entry that left it Deleted).
A decided delete only tombstones once the driver reported everything gone, but something can
appear after that: a launch still running in an executor that lost its partition, a sandbox
deleted under older rules (a runtime's removal used to tombstone it, its volume left behind).
They are passed to ``collect`` (``Executor.collect``), which deletes that incarnation, and
only it (never a live incarnation of the same name, nor anything this store never knew).

It also hands the executor what the log can no longer deliver: a row that stays in a
progressing phase (Provisioning, Starting, Stopping, Deleting) at the same version for a whole
pass is passed to ``pickup`` (``Executor.pick_up``), which queues what the row wants unless
the executor already has intents of that sandbox. This is how a new executor group, which
starts at the end of the events topic, catches up with what was decided before it joined.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from uuid import UUID

import asyncpg

from drivers.protocol import Driver, HoldingsDriver, Incarnation, RuntimeInfo
from events.backoff import pause
from events.common import Phase
from events.observations import Observation, RuntimeRemoved, RuntimeSnapshot
from events.publisher import RenewingProducer, publish_observation
from projections.lifecycle import Sandbox
from services.common.settings import Settings
from services.executor.clock import Clock, utcnow
from services.executor.rows import progressing_rows

log = logging.getLogger("sandstream.reconcile")


# Phases in which the current generation's runtime must exist; its absence is news.
# (Provisioning and Starting: the launch may not have created it yet. Stopped, Completed,
# Error: nothing needs it any more; a start launches a new generation.)
EXPECTS_RUNTIME = (Phase.READY, Phase.STOPPING)
# Phases in which a launch may still be removing the older generations' runtimes.
LAUNCHING = (Phase.PROVISIONING, Phase.STARTING)


# A difference reported: its observation id, and the version of its key's row (None: none).
Reported = tuple[str, int | None]


@dataclass(frozen=True, slots=True)
class LiveRow:
    key: str
    sandbox_id: UUID
    generation: int
    phase: Phase
    version: int


def reconcile(
    rows: Iterable[LiveRow], runtimes: Iterable[RuntimeInfo], now: datetime
) -> list[Observation]:
    """Observations for the differences between the rows and the runtime listing (pure).

    - *vanished*: a row that needs its current generation's runtime (Ready, Stopping) and no
      such runtime in the listing → ``RuntimeRemoved`` of that generation;
    - *orphan*: a runtime with no live row of its key, of another incarnation than the row,
      or of an older generation than the row's (unless a launch, which removes those, is in
      flight) → a ``RuntimeSnapshot`` of it, which the processor records as ignored;
    - *stray*: a runtime of a Stopped row's own generation that runs (``stray_runtimes``) →
      a ``RuntimeSnapshot`` of it (ignored in Stopped: the row stays Stopped, the executor
      stops the runtime);
    - *exited*: a Ready row's own runtime that has exited (``exited_runtimes``) → a
      ``RuntimeSnapshot`` of it, which the processor takes as the exit it missed (Error or
      Completed, and the restart policy). The watch normally reports an exit; this catches
      one it lost (a watch that was away, an event Podman 4.3 dropped at a log rotation) or
      one a late running undid before that lifted nothing (``exited_at``).

    Read the rows before listing the runtimes: a runtime launched after the rows were read is
    then at worst reported as an orphan of a newer generation, which the processor ignores or
    (when it is the current one by then) takes as the truth it is.
    Observation ids are deterministic, so repeated passes repeat the same ids.
    """
    by_key = {r.key: r for r in rows}
    runtimes = list(runtimes)
    present = {(rt.key, rt.sandbox_id, rt.generation) for rt in runtimes}
    out: list[Observation] = []
    for rt in runtimes:
        row = by_key.get(rt.key)
        orphan = (
            row is None
            or row.sandbox_id != rt.sandbox_id
            or (rt.generation < row.generation and row.phase not in LAUNCHING)
        )
        if orphan:
            out.append(_reported("orphan", rt, now))
    out += [_reported("stray", rt, now) for rt in stray_runtimes(by_key.values(), runtimes)]
    out += [_reported("exited", rt, now) for rt in exited_runtimes(by_key.values(), runtimes)]
    for row in by_key.values():
        if (
            row.phase in EXPECTS_RUNTIME
            and (row.key, row.sandbox_id, row.generation) not in present
        ):
            out.append(
                RuntimeRemoved(
                    type="RuntimeRemoved",
                    observation_id=f"reconcile:vanished:{row.sandbox_id}:{row.generation}",
                    key=row.key,
                    generation=row.generation,
                    occurred_at=now,
                    actor="reconciler",
                    source="reconcile",
                )
            )
    return out


def stale_runtimes(rows: Iterable[LiveRow], runtimes: Iterable[RuntimeInfo]) -> list[RuntimeInfo]:
    """Runtimes of a live row's incarnation, of an older generation than the row's, not exited,
    while the row is neither launching (its launch removes them) nor deleting (pure)."""
    by_key = {r.key: r for r in rows}
    return [
        rt
        for rt in runtimes
        if (row := by_key.get(rt.key)) is not None
        and row.sandbox_id == rt.sandbox_id
        and rt.generation < row.generation
        and row.phase not in (*LAUNCHING, Phase.DELETING)
        and rt.state != "exited"
    ]


def _reported(difference: str, rt: RuntimeInfo, now: datetime) -> RuntimeSnapshot:
    """A snapshot of ``rt`` reporting a difference (its id names it, deterministically), as
    of when the runtime entered its state, as the watch's are: an exit the processor takes
    from it (the row's own runtime, or an orphan that is the current one by then) schedules
    the restart and resets its back-off from the exit, not from this pass. Never later than
    ``now``: a backend's clock may run ahead."""
    return RuntimeSnapshot(
        type="RuntimeSnapshot",
        observation_id=f"reconcile:{difference}:{rt.runtime_id}:{rt.state}",
        key=rt.key,
        generation=rt.generation,
        occurred_at=min(rt.since or now, now),
        actor="reconciler",
        state=rt.state,
        exit_code=rt.exit_code,
        runtime_id=rt.runtime_id,
        source="reconcile",
    )


def exited_runtimes(rows: Iterable[LiveRow], runtimes: Iterable[RuntimeInfo]) -> list[RuntimeInfo]:
    """Runtimes of a Ready row's own incarnation and generation that have exited (pure): a
    Ready row's runtime runs, so its exit was missed."""
    by_key = {r.key: r for r in rows}
    return [
        rt
        for rt in runtimes
        if rt.state == "exited"
        and (row := by_key.get(rt.key)) is not None
        and row.phase is Phase.READY
        and (row.sandbox_id, row.generation) == (rt.sandbox_id, rt.generation)
    ]


def stray_runtimes(rows: Iterable[LiveRow], runtimes: Iterable[RuntimeInfo]) -> list[RuntimeInfo]:
    """Runtimes of a Stopped row's own incarnation and generation that run (not one still
    stopping: it is on its way out) (pure)."""
    by_key = {r.key: r for r in rows}
    return [
        rt
        for rt in runtimes
        if (row := by_key.get(rt.key)) is not None
        and row.phase is Phase.STOPPED
        and (row.sandbox_id, row.generation) == (rt.sandbox_id, rt.generation)
        and rt.state == "running"
    ]


def suspended_leftovers(
    rows: Iterable[LiveRow], runtimes: Iterable[RuntimeInfo]
) -> list[RuntimeInfo]:
    """Runtimes of a Suspended row's own incarnation and generation, in any state (pure): its
    suspend removed them, so one left was made or kept behind sandstream's back, or the
    suspend's removal was lost; no event will ask for it. (Older generations' are stale
    runtimes or orphans, as under any row.)"""
    by_key = {r.key: r for r in rows}
    return [
        rt
        for rt in runtimes
        if (row := by_key.get(rt.key)) is not None
        and row.phase is Phase.SUSPENDED
        and (row.sandbox_id, row.generation) == (rt.sandbox_id, rt.generation)
    ]


def leftover_candidates(rows: Iterable[LiveRow], held: Iterable[Incarnation]) -> set[Incarnation]:
    """The incarnations the backend holds that no live row is (pure): a deleted incarnation's
    leftovers, or a stranger's (another control plane's, or one created after the rows were
    read). ``deleted_incarnations`` tells them apart."""
    live = {(r.key, r.sandbox_id) for r in rows}
    return {i for i in held if i not in live}


async def deleted_incarnations(
    pool: asyncpg.Pool[asyncpg.Record], candidates: Iterable[Incarnation]
) -> dict[Incarnation, int]:
    """Which of ``candidates`` this store tombstoned, with the generation of the tombstone:
    the row's tombstone, or (a name re-created since) the history entry that left it Deleted."""
    wanted = sorted(candidates)
    if not wanted:
        return {}
    records = await pool.fetch(
        """
        SELECT key, sandbox_id, generation FROM sandboxes
         WHERE phase = 'Deleted' AND sandbox_id = ANY($1::uuid[])
        UNION
        SELECT key, sandbox_id, generation FROM history
         WHERE phase = 'Deleted' AND sandbox_id = ANY($1::uuid[])
        """,
        [sandbox_id for _, sandbox_id in wanted],
    )
    keys = set(wanted)
    found: dict[Incarnation, int] = {}
    for r in records:
        incarnation = (r["key"], r["sandbox_id"])
        if incarnation in keys:
            found[incarnation] = max(found.get(incarnation, 0), r["generation"])
    return found


async def live_rows(pool: asyncpg.Pool[asyncpg.Record]) -> list[LiveRow]:
    rows = await pool.fetch(
        "SELECT key, sandbox_id, generation, phase, version FROM sandboxes WHERE phase <> 'Deleted'"
    )
    return [
        LiveRow(r["key"], r["sandbox_id"], r["generation"], Phase(r["phase"]), r["version"])
        for r in rows
    ]


@dataclass
class Reconciler:
    """Every ``interval`` seconds: read the live rows, list the runtimes, report differences.

    Each difference is reported once while it lasts at its row's version (by observation id
    and the version of its key's row): a vanished runtime stays vanished, and an orphan is
    audit, not an alarm to repeat every pass. Only the differences of the latest pass are
    remembered, so the memory is bounded by them, and one that goes away and comes back is
    reported again. So is one whose row changed meanwhile: a Ready row whose exit was reported,
    decided (Error) and undone (a running dated after the exit lifted it Ready again) between
    two passes still shows the same difference, and only a new report ends it.
    """

    driver: Driver
    pool: asyncpg.Pool[asyncpg.Record]
    producer: RenewingProducer
    settings: Settings
    interval: float
    clock: Clock = utcnow
    passes: int = 0  # completed passes (tests wait on it)
    reported: set[Reported] = field(default_factory=set)
    pickup: Callable[[Sandbox], bool] | None = None  # the executor's pick_up
    # False: only the pick-up (an executor process, when a watcher process reports the
    # differences: it holds the watcher lease, so they are reported once, not by every executor).
    report: bool = True
    picked_up: int = 0
    stop_stale: Callable[[RuntimeInfo], bool] | None = None  # the executor's stop_stale
    stale_stopped: int = 0  # stale runtimes handed to stop_stale
    stop_stray: Callable[[RuntimeInfo], bool] | None = None  # the executor's stop_stray
    strays_stopped: int = 0  # runtimes under a Stopped row handed to stop_stray
    # The executor's remove_suspended: suspend again a runtime left under a Suspended row.
    remove_suspended: Callable[[RuntimeInfo], bool] | None = None
    suspended_removed: int = 0  # runtimes under a Suspended row handed to remove_suspended
    # The executor's collect: delete a tombstoned incarnation's leftovers (key, sandbox id,
    # the tombstone's generation).
    collect: Callable[[str, UUID, int], bool] | None = None
    collected: int = 0  # deleted incarnations' leftovers handed to collect
    _progressing: set[tuple[str, UUID, int]] = field(default_factory=set)  # the last pass's

    async def pick_up_stuck(self) -> None:
        """Hand the executor each row still progressing at the version the last pass saw."""
        if self.pickup is None:
            return
        rows = await progressing_rows(self.pool)
        now = {(r.key, r.sandbox_id, r.version) for r in rows}
        for row in rows:
            if (row.key, row.sandbox_id, row.version) in self._progressing and self.pickup(row):
                self.picked_up += 1
        self._progressing = now

    async def collect_leftovers(self, rows: list[LiveRow]) -> None:
        """Hand the executor each tombstoned incarnation the backend still holds anything of.
        ``rows`` were read before the listing: a sandbox created after them is no candidate
        while this store has not tombstoned it; one created and deleted during the pass is
        collected too: a second delete of what its own delete removed (harmless, audited)."""
        if self.collect is None or not isinstance(self.driver, HoldingsDriver):
            return
        candidates = leftover_candidates(rows, await self.driver.incarnations())
        deleted = await deleted_incarnations(self.pool, candidates)
        for (key, sandbox_id), generation in sorted(deleted.items()):
            self.collected += self.collect(key, sandbox_id, generation)

    async def run_once(self) -> list[Observation]:
        """One pass; returns what it reported (new differences only)."""
        await self.pick_up_stuck()
        acts = (self.stop_stale, self.stop_stray, self.remove_suspended, self.collect)
        if not self.report and all(act is None for act in acts):
            self.passes += 1
            return []
        rows = await live_rows(self.pool)
        try:
            await self.collect_leftovers(rows)
        except Exception:  # the reports and stops below do not depend on it
            log.exception("collecting deleted incarnations' leftovers failed; next pass retries")
        runtimes = await self.driver.list()
        if self.stop_stale is not None:
            for runtime in stale_runtimes(rows, runtimes):
                self.stale_stopped += self.stop_stale(runtime)
        if self.stop_stray is not None:
            for runtime in stray_runtimes(rows, runtimes):
                self.strays_stopped += self.stop_stray(runtime)
        if self.remove_suspended is not None:
            for runtime in suspended_leftovers(rows, runtimes):
                self.suspended_removed += self.remove_suspended(runtime)
        if not self.report:
            self.passes += 1
            return []
        current = reconcile(rows, runtimes, self.clock())
        versions = {r.key: r.version for r in rows}

        def difference(o: Observation) -> Reported:
            return o.observation_id, versions.get(o.key)

        still = {difference(o) for o in current} & self.reported
        sent = []
        for observation in current:
            if difference(observation) in still:
                continue
            await publish_observation(self.producer, self.settings.topic_observations, observation)
            still.add(difference(observation))
            sent.append(observation)
            # Orphans are often another sandstream's containers on the same host: audit only.
            orphan = observation.observation_id.startswith("reconcile:orphan:")
            stray = observation.observation_id.startswith("reconcile:stray:")
            level = logging.WARNING if stray else logging.DEBUG if orphan else logging.INFO
            log.log(level, "reconcile: reported %s", observation.observation_id)
        self.reported = still
        self.passes += 1
        return sent

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.run_once()
            except Exception:
                log.exception("reconcile pass failed; next pass in %ss", self.interval)
            if await pause(stop, self.interval):
                return
