"""The checker's end checks, run once every fault is healed and the system has settled.

Each check is a pure function from what was read to ``Finding``s (a lost item, a duplicated
one, or a divergence: anything else that is not as it must be), next to the function that reads
its inputs from PostgreSQL (the run's schema), the log or the backend. The audit tools
(re-decide, rebuild) are reused as they are.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import asyncpg

from drivers.protocol import RuntimeInfo
from events.codec import EVENTS, decode
from events.log_reader import read_to_end
from services.audit.verify import verify
from services.chaos.workload import Sent
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.processor.rebuild import rebuild_and_compare

Kind = Literal["lost", "duplicated", "divergence", "ended"]
Pool: TypeAlias = "asyncpg.Pool[asyncpg.Record]"
PROGRESSING = ("Provisioning", "Starting", "Stopping", "Suspending", "Deleting")


@dataclass(frozen=True)
class Finding:
    kind: Kind
    check: str
    detail: str


@dataclass(frozen=True)
class EventStats:
    decided: int  # decided events in the outbox
    on_topic: int  # records on sandbox.events
    republished: int  # repeats of an event already on the topic (at least once after a crash)


# --------------------------------------------------------------------------- roles


def ended_roles(ended: Iterable[tuple[str, int]]) -> list[Finding]:
    """A role process found exited after the faults were healed ended by itself: no fault
    stops one for good, so it crashed (a supervisor would restart it; the checker does not,
    which would hide the crash)."""
    detail = "{0} ended by itself with exit code {1} (its log: logs/{0}.log)"
    return [Finding("ended", "roles", detail.format(name, code)) for name, code in ended]


# --------------------------------------------------------------------------- commands


def command_findings(
    sent: Iterable[Sent], outcomes: Counter[str], decisions: Counter[str]
) -> list[Finding]:
    """Every acknowledged command has exactly one outcome and one decision (a history entry
    other than a duplicate); no outcome or decision without a command that was sent."""
    by_id = {s.command_id: s for s in sent}
    found = [
        Finding("lost", "commands", f"{s.kind} {s.command_id} of {s.key}: acknowledged, no outcome")
        for s in by_id.values()
        if s.acknowledged and outcomes[s.command_id] == 0
    ]
    for cid in sorted(outcomes.keys() | decisions.keys()):
        counts = f"{cid}: {outcomes[cid]} outcomes, {decisions[cid]} decisions"
        if cid not in by_id:
            found.append(Finding("divergence", "commands", f"never sent: {counts}"))
        elif outcomes[cid] > 1 or decisions[cid] > 1:
            found.append(Finding("duplicated", "commands", counts))
        elif outcomes[cid] != decisions[cid]:
            found.append(Finding("divergence", "commands", counts))
    return found


async def commands(pool: Pool, sent: Iterable[Sent]) -> list[Finding]:
    outcomes = await pool.fetch("SELECT command_id FROM command_outcomes")
    decisions = await pool.fetch(
        "SELECT command_id FROM history WHERE command_id IS NOT NULL AND disposition <> 'duplicate'"
    )
    return command_findings(
        sent,
        Counter(r["command_id"] for r in outcomes),
        Counter(r["command_id"] for r in decisions),
    )


# --------------------------------------------------------------------------- history


def history_findings(entries: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """Per sandbox, in decision order: an applied input moves the version up by one, any other
    leaves it; so versions are contiguous and none is decided twice."""
    found = []
    last: dict[str, int] = {}
    for e in entries:
        before = last.get(e["key"], 0)
        applied = e["disposition"] == "applied"
        if e["version"] != (before + 1 if applied else before):
            kind: Kind = "duplicated" if applied and e["version"] <= before else "divergence"
            what = f"version {e['version']} after {before} ({e['disposition']})"
            found.append(Finding(kind, "history", f"{e['key']} entry {e['id']}: {what}"))
        last[e["key"]] = e["version"]
    return found


async def history(pool: Pool) -> list[Finding]:
    entries = await pool.fetch(
        "SELECT key, disposition, version, id FROM history "
        "WHERE key IS NOT NULL AND version IS NOT NULL ORDER BY key, id"
    )
    return history_findings([dict(e) for e in entries])


# --------------------------------------------------------------------------- the audit tools


async def redecided(settings: Settings) -> list[Finding]:
    """Re-deciding every input from the log gives the recorded decisions, events and rows, and
    every log record below the stored offsets is recorded (services/audit/verify.py)."""
    report = await verify(settings)
    found = [Finding("divergence", "re-decide", d.describe()) for d in report.divergences]
    if report.chains is not None:
        found += [Finding("divergence", "hash chain", repr(b)) for b in report.chains.broken]
    if report.pending:
        found.append(Finding("divergence", "re-decide", f"{report.pending} inputs undecided"))
    return found


async def rebuild(settings: Settings) -> list[Finding]:
    """The rows equal a rebuild from sandbox.events (services/processor/rebuild.py)."""
    report = await rebuild_and_compare(settings)
    return [Finding("divergence", "rebuild", d) for d in report.differences]


# --------------------------------------------------------------------------- decided events


def event_findings(
    decided: Mapping[str, Sequence[tuple[str, int]]],
    published: Mapping[str, Sequence[str]],
    where: Mapping[str, Sequence[str]] | None = None,
) -> tuple[list[Finding], int]:
    """``decided``: per sandbox its (event id, version) in decision order (the outbox);
    ``published``: per sandbox the event ids on sandbox.events in offset order. Every decided
    event is published, first publications in decision order, versions contiguous; a repeat of
    an event already published (after a processor crash) is counted, not a finding.
    ``where``: per sandbox the place (``partition@offset``) of each of ``published``'s
    records, for the evidence."""
    where = where or {}
    found: list[Finding] = []
    republished = 0
    for key in sorted(decided.keys() | published.keys()):
        want = [eid for eid, _ in decided.get(key, ())]
        versions = [v for _, v in decided.get(key, ())]
        if versions and versions != list(range(versions[0], versions[0] + len(versions))):
            found.append(Finding("divergence", "events", f"{key}: versions {versions}"))
        seen = published.get(key, ())
        first = list(dict.fromkeys(seen))
        republished += len(seen) - len(first)
        missing = set(want) - set(first)
        if missing:
            found.append(Finding("lost", "events", f"{key}: {len(missing)} events unpublished"))
        extra = set(first) - set(want)
        if extra:
            found.append(Finding("divergence", "events", f"{key}: events nobody decided"))
        if not missing and not extra and first != want:
            found.append(Finding("divergence", "events", f"{key}: published out of order: "
                                 f"{_order(decided[key], seen, where.get(key, ()))}"))  # fmt: skip
    return found, republished


def _order(decided: Sequence[tuple[str, int]], seen: Sequence[str], where: Sequence[str]) -> str:
    """The evidence of an order finding: each publication's version and place on the topic,
    in offset order (a repeat marked), beside the versions in decision order."""
    version = dict(decided)
    marks, shown = [], set()
    for eid, place in itertools.zip_longest(seen, where, fillvalue="?"):
        marks.append(f"v{version[eid]}@{place}" + ("(again)" if eid in shown else ""))
        shown.add(eid)
    return f"decided v{decided[0][1]}..v{decided[-1][1]}; on the topic {' '.join(marks)}"


async def events(settings: Settings, pool: Pool) -> tuple[list[Finding], EventStats]:
    decided: dict[str, list[tuple[str, int]]] = defaultdict(list)
    records = await pool.fetch("SELECT value FROM outbox WHERE topic = $1 ORDER BY id",
                               settings.topic_events)  # fmt: skip
    for r in records:
        event = decode(EVENTS, r["value"])
        decided[event.key].append((str(event.event_id), event.version))
    published: dict[str, list[str]] = defaultdict(list)
    where: dict[str, list[str]] = defaultdict(list)
    on_topic = 0
    async for record in read_to_end(
        kafka_client_args(settings, "admin"), settings.topic_events, settings.kafka_partitions
    ):
        event = decode(EVENTS, record.value)
        published[event.key].append(str(event.event_id))
        where[event.key].append(f"{record.partition}@{record.offset}")
        on_topic += 1
    found, republished = event_findings(decided, published, where)
    return found, EventStats(len(records), on_topic, republished)


# --------------------------------------------------------------------------- the backend


def backend_findings(
    rows: Sequence[Mapping[str, Any]], runtimes: Iterable[RuntimeInfo]
) -> list[Finding]:
    """The backend agrees with the rows (key, sandbox_id, generation, phase): the current
    generation runs for every Ready row, nothing runs for a Stopped or deleted one, and no row
    is left in a progressing phase."""
    running: dict[str, list[RuntimeInfo]] = defaultdict(list)
    for rt in runtimes:
        if rt.state == "running":
            running[rt.key].append(rt)
    found = []
    for row in sorted(rows, key=lambda r: str(r["key"])):
        key, phase = row["key"], row["phase"]
        current = [
            rt
            for rt in running[key]
            if rt.sandbox_id == row["sandbox_id"] and rt.generation == row["generation"]
        ]
        if phase in PROGRESSING:
            found.append(Finding("divergence", "backend", f"{key}: still {phase}"))
        elif phase == "Ready" and not current:
            found.append(Finding("divergence", "backend", f"{key}: Ready, nothing runs"))
        elif phase in ("Stopped", "Deleted") and running[key]:
            ids = [rt.runtime_id for rt in running[key]]
            found.append(Finding("divergence", "backend", f"{key}: {phase}, yet {ids} run"))
    for key in sorted(running.keys() - {r["key"] for r in rows}):
        found.append(Finding("divergence", "backend", f"{key}: runs without a row"))
    return found


@dataclass(frozen=True)
class BackendStats:
    """What the backend check covered: rows in all, and those of sandboxes on real Podman
    (named with its prefix), with their running containers and their divergences."""

    rows: int
    podman_rows: int
    podman_running: int
    podman_divergences: int


def backend_stats(
    rows: Sequence[Mapping[str, Any]],
    runtimes: Iterable[RuntimeInfo],
    findings: Iterable[Finding],
    podman_prefix: str,
) -> BackendStats:
    def podman(key: str) -> bool:
        return key.startswith(podman_prefix)

    return BackendStats(
        rows=len(rows),
        podman_rows=sum(1 for r in rows if podman(r["key"])),
        podman_running=sum(1 for rt in runtimes if podman(rt.key) and rt.state == "running"),
        podman_divergences=sum(1 for f in findings if podman(f.detail)),
    )


Rows: TypeAlias = Sequence[Mapping[str, Any]]


async def agreeing_runtimes(
    snapshot: Callable[[], Awaitable[tuple[Rows, Sequence[RuntimeInfo]]]],
    within: float,
    every: float = 0.5,
) -> Sequence[RuntimeInfo]:
    """The backend's runtimes once they agree with the rows (``backend_findings``), or as they
    are after ``within`` seconds. The executors' reconcile loop stops a runtime of an older
    generation left by an executor killed after its launch (docs/drivers.md, "Stale
    generations") at its next pass, not at once: the end check gives it that long."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        rows, runtimes = await snapshot()
        if not backend_findings(rows, runtimes) or loop.time() >= deadline:
            return runtimes
        await asyncio.sleep(every)


async def observed_running(pool: Pool, sandbox_id: object, generation: int, actor: str) -> bool:
    """Whether an observation by ``actor`` of the generation running was decided."""
    query = (
        "SELECT EXISTS (SELECT 1 FROM history WHERE sandbox_id = $1 AND message->>'actor' = $2"
        " AND (message->>'generation')::int = $3 AND message->>'state' = 'running')"
    )
    return bool(await pool.fetchval(query, sandbox_id, actor, generation))


async def backend_rows(pool: Pool) -> list[dict[str, Any]]:
    """What the backend check compares the runtimes with, of every row."""
    records = await pool.fetch("SELECT key, sandbox_id, generation, phase FROM sandboxes")
    return [dict(r) for r in records]


async def backend(
    pool: Pool, runtimes: Sequence[RuntimeInfo], podman_prefix: str
) -> tuple[list[Finding], BackendStats]:
    rows = await backend_rows(pool)
    found = backend_findings(rows, runtimes)
    return found, backend_stats(rows, runtimes, found, podman_prefix)
