"""The Podman watch stream's mapping: container events and listings to observations (ids,
times, exit codes), and the removal of a runtime that vanished while the stream was away.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from drivers.labels import parse_labels
from drivers.podman_objects import ACTOR, Container, from_nanos, parse_time
from drivers.protocol import WatchObservation
from events.observations import RuntimeRemoved, RuntimeSnapshot, RuntimeState
from events.recent import RecentIds

# The container events that change what a sandbox looks like; the rest (init, cleanup, kill,
# exec, exec_died, attach, ...) are ignored. A paused container is reported as the listings
# report it (stopping: a process, running nothing); an unpaused one runs again.
EVENT_STATES: Final[Mapping[str, RuntimeState]] = {
    "create": "created",
    "start": "running",
    "died": "exited",
    "pause": "stopping",
    "unpause": "running",
}
EVENT_REMOVE: Final = "remove"

# Event ids a watch remembers, to skip what Podman 4.3's stream sends again after rotating its
# event log (the newer half of it; 1 MB by default, about 1,700 events): a start sent again after
# the runtime's exit would make an exited sandbox look running.
REPORTED_EVENTS: Final = 4096

# A start event this close after the start a watch already knows of (from its listing, whose
# times are whole seconds, or from an event it reported) is that start again: Podman 4.3's
# stream sends the newer half of its event log again after rotating it, starts from before the
# watch began among them, and a start between the stream's opening and the listing comes after
# the listing that shows it. sandstream starts a container once (a new generation is a new
# container), so only a start by hand within ``SAME_START`` of the last could be taken for it.
SAME_START: Final = timedelta(seconds=2)


class SentAgain:
    """What a watch has had already, to skip what Podman 4.3's stream sends again: the ids of
    the last ``REPORTED_EVENTS`` events it reported, and the start of each runtime it knows of,
    from its listing or a start event it reported (a start event of it: ``SAME_START``)."""

    def __init__(self) -> None:
        self._reported = RecentIds(REPORTED_EVENTS)
        self._starts: dict[str, datetime] = {}

    def listed(self, listing: Sequence[Container]) -> None:
        self._starts = {c.info.runtime_id: c.started for c in listing if c.started}

    def seen(self, observation: WatchObservation) -> bool:
        """Whether the watch has had ``observation`` already; else it is noted as reported."""
        if self._reported.seen(observation.observation_id):
            return True
        runtime_id = observation.runtime_id or ""
        if isinstance(observation, RuntimeRemoved):
            self._starts.pop(runtime_id, None)
            return False
        if known_start(observation, self._starts):
            return True
        if observation.state == "running" and observation.source == "watch":
            self._starts[runtime_id] = observation.occurred_at
        return False


def known_start(observation: WatchObservation, started: Mapping[str, datetime]) -> bool:
    """Whether ``observation`` is a start event of a start ``started`` already holds. Only a
    start event: an unpause also reports running, and one soon after the start is news (a
    container paused and unpaused within ``SAME_START`` stayed reported paused)."""
    if not isinstance(observation, RuntimeSnapshot) or observation.source != "watch":
        return False
    if observation.state != "running" or event_action(observation) != "start":
        return False
    known = started.get(observation.runtime_id or "")
    return known is not None and observation.occurred_at <= known + SAME_START


def event_action(observation: WatchObservation) -> str:
    """The Podman event an observation of the watch was made of (the last part of the id
    ``observation_from_event`` gives it)."""
    return observation.observation_id.rpartition(":")[2]


def snapshot_from_list(container: Container, *, actor: str = ACTOR) -> RuntimeSnapshot:
    """A source="list" snapshot; its id is stable while the container's state is unchanged."""
    info, since = container.info, container.since
    stamp = int(since.timestamp()) if since else 0
    now = datetime.now(UTC)  # a listed exit's time is the end of its second: never past now
    return RuntimeSnapshot(
        type="RuntimeSnapshot",
        observation_id=f"podman-list:{info.runtime_id}:{info.state}:{stamp}",
        key=info.key,
        generation=info.generation,
        occurred_at=min(since, now) if since else now,
        actor=actor,
        state=info.state,
        exit_code=info.exit_code,
        runtime_id=info.runtime_id,
        source="list",
    )


def observation_from_event(
    event: Mapping[str, Any], *, actor: str = ACTOR, exit_code: int | None = None
) -> WatchObservation | None:
    """Map one Podman container event to an observation; None for events we ignore.

    Podman 4.3 puts the container's labels in ``Actor.Attributes`` and, on ``died``, the exit
    code in ``containerExitCode``. ``exit_code`` overrides it (after an inspect).
    """
    action = str(event.get("Action") or event.get("status") or "")
    if action not in EVENT_STATES and action != EVENT_REMOVE:
        return None
    if event.get("Type", event.get("type", "container")) != "container":
        return None
    event_actor = event.get("Actor") or {}
    attributes = event_actor.get("Attributes") or {}
    labels = parse_labels(attributes)
    if labels is None:
        return None
    runtime_id = str(event_actor.get("ID") or event.get("id") or "")
    nanos = event.get("timeNano")
    if isinstance(nanos, int) and nanos > 0:
        occurred_at = from_nanos(nanos)
    else:
        seconds = event.get("time")
        occurred_at = parse_time(seconds) or datetime.now(UTC)
        nanos = int(occurred_at.timestamp() * 1_000_000_000)
    observation_id = f"podman:{runtime_id}:{nanos}:{action}"
    if action == EVENT_REMOVE:
        return RuntimeRemoved(
            type="RuntimeRemoved",
            observation_id=observation_id,
            key=labels.key,
            generation=labels.generation,
            occurred_at=occurred_at,
            actor=actor,
            runtime_id=runtime_id or None,
            source="watch",
        )
    state = EVENT_STATES[action]
    if state == "exited" and exit_code is None:
        exit_code = event_exit_code(event)
    return RuntimeSnapshot(
        type="RuntimeSnapshot",
        observation_id=observation_id,
        key=labels.key,
        generation=labels.generation,
        occurred_at=occurred_at,
        actor=actor,
        state=state,
        exit_code=exit_code if state == "exited" else None,
        runtime_id=runtime_id or None,
        source="watch",
    )


def event_exit_code(event: Mapping[str, Any]) -> int | None:
    attributes = (event.get("Actor") or {}).get("Attributes") or {}
    try:
        return int(attributes["containerExitCode"])
    except (KeyError, TypeError, ValueError):
        return None


def removed_while_away(
    runtime_id: str, key: str, generation: int, *, actor: str = ACTOR
) -> RuntimeRemoved:
    """A runtime known before a reconnect and missing from the new listing."""
    return RuntimeRemoved(
        type="RuntimeRemoved",
        observation_id=f"podman-list:{runtime_id}:removed",
        key=key,
        generation=generation,
        occurred_at=datetime.now(UTC),
        actor=actor,
        runtime_id=runtime_id,
        source="list",
    )
