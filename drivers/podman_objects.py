"""What the Podman driver names and reads back: container and volume names, a container parsed
from a list or inspect answer, Podman's statuses and times, and how its errors are classified.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final
from uuid import UUID

from podman import PodmanClient
from podman.errors import APIError, NotFound, PodmanError

from drivers.labels import parse_labels, workspace_labels
from drivers.protocol import RuntimeInfo
from events.observations import RuntimeState

log = logging.getLogger("sandstream.drivers.podman")

ACTOR: Final = "podman-watcher"
# Podman container statuses -> the states of the protocol. "stopping" (a stop has sent its
# signal and waits out the grace period) still has a process but is on its way out: stopping,
# never running, which would lift an Error row to Ready. "paused" (`podman pause`: frozen by
# its cgroup) has a process that a stop must still end but runs nothing: stopping too, never
# running. "stopped" has no process but is not cleaned up yet; "removing" is on its way out.
STATES: Final[Mapping[str, RuntimeState]] = {
    "created": "created",
    "configured": "created",
    "initialized": "created",
    "running": "running",
    "paused": "stopping",
    "stopping": "stopping",
    "stopped": "exited",
    "exited": "exited",
    "dead": "exited",
    "removing": "exited",
}
# Errors a retry cannot fix, as Podman 4.3 words them (it answers most failures with a 500).
_PERMANENT = ("image not known", "invalid reference format", "executable file not found")
# Errors from the podman package and the HTTP stack under it (requests' exceptions are
# OSErrors, and so are socket errors): these become DriverErrors; anything else is a bug.
BACKEND_ERRORS: Final = (PodmanError, OSError)
# The states with a process, which a stop or a kill still has to end.
ALIVE: Final[frozenset[RuntimeState]] = frozenset({"running", "stopping"})


def container_name(key: str, generation: int) -> str:
    return f"sandstream-{key}-g{generation}"


def volume_name(key: str, sandbox_id: UUID) -> str:
    return f"sandstream-{key}-{sandbox_id.hex[:12]}"


def ensure_volume(client: PodmanClient, key: str, sandbox_id: UUID) -> None:
    """The incarnation's workspace volume, created unless it exists (by a concurrent launch
    too)."""
    volume = volume_name(key, sandbox_id)
    try:
        client.volumes.get(volume)
    except NotFound:
        try:
            client.volumes.create(volume, labels=workspace_labels(key, sandbox_id))
        except APIError as exc:
            if "already exists" not in str(exc):
                raise


def remove_volume(client: PodmanClient, name: str, *, force: bool = False) -> None:
    """Remove a volume; one that is gone already counts as removed. Podman 4.3 answers a
    volume removed by someone else between its lookup and its removal with 500 "no such
    volume", not 404 (two deletes of one sandbox racing: a killed executor's and its
    successor's)."""
    try:
        client.volumes.remove(name, force=force)
    except NotFound:
        return
    except APIError as exc:
        if "no such volume" not in str(exc):
            raise


def parse_time(value: object) -> datetime | None:
    """Podman timestamps: unix seconds (list) or RFC 3339 with nanoseconds (inspect)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value <= 0:
            return None
        return datetime.fromtimestamp(value, UTC)
    if isinstance(value, str) and value and not value.startswith("0001-"):
        match = re.match(r"^(.*T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$", value)
        if match is None:
            return None
        head, fraction, zone = match.groups()
        fraction = (fraction or "")[:7]  # a dot and at most 6 digits
        return datetime.fromisoformat(head + fraction + ("+00:00" if zone == "Z" else zone))
    return None


def latest_in_second(value: object) -> datetime | None:
    """A list item's exit time (whole unix seconds) as the last instant of its second.

    The watch dates a start to the nanosecond, a listing an exit only to the second: a runtime
    that exits in the second it started would show a listed exit before its own start, and a
    start Podman sends again would then lift the Error as news (ran_before_its_exit). The end
    of the second is an upper bound of the exit; readers bound it by their own clock. The cost:
    a runtime started again behind sandstream's back in that same second reads as late.
    """
    second = parse_time(value)
    return second + timedelta(microseconds=999_999) if second is not None else None


def from_nanos(nanos: int) -> datetime:
    seconds, rest = divmod(nanos, 1_000_000_000)
    return datetime.fromtimestamp(seconds, UTC) + timedelta(microseconds=rest // 1000)


@dataclass(frozen=True, slots=True)
class Container:
    """A sandstream container as read from a list or inspect answer."""

    info: RuntimeInfo
    name: str | None
    stop_timeout: int | None = None  # from the stop-timeout label, if any
    # Podman shows a stop under way as "stopping", which is not "terminating": a launch adopts
    # such a container of its generation (it does not replace it), whose exit the watcher then
    # reports.
    terminating: bool = False
    started: datetime | None = None  # its last start (None: never started)

    @property
    def since(self) -> datetime | None:
        """When it entered its current state."""
        return self.info.since


def read_container(attrs: Mapping[str, Any]) -> Container | None:
    """Parse a list item (State is a string) or an inspect answer (State is a dict)."""
    config = attrs.get("Config") or {}
    labels = parse_labels(attrs.get("Labels") or config.get("Labels"))
    if labels is None or labels.sandbox_id is None:
        return None
    raw_state = attrs.get("State")
    inspected = isinstance(raw_state, Mapping)  # a list item's State is a string
    if isinstance(raw_state, Mapping):
        status = str(raw_state.get("Status", ""))
        exit_code = raw_state.get("ExitCode")
        started, finished = raw_state.get("StartedAt"), raw_state.get("FinishedAt")
    else:
        status = str(raw_state or "")
        exit_code = attrs.get("ExitCode")
        started, finished = attrs.get("StartedAt"), attrs.get("ExitedAt")
    state = STATES.get(status.lower())
    if state is None:
        log.warning("container %s has unknown status %r; skipped", attrs.get("Id"), status)
        return None
    created = parse_time(attrs.get("Created"))
    # Podman records no time for the start of a stop: a stopping container's is its start.
    since = {
        "created": created,
        "running": parse_time(started),
        "stopping": parse_time(started),
        "exited": parse_time(finished) if inspected else latest_in_second(finished),
    }
    names = attrs.get("Names")
    name = attrs.get("Name") or (names[0] if names else None)
    info = RuntimeInfo(
        key=labels.key,
        sandbox_id=labels.sandbox_id,
        generation=labels.generation,
        state=state,
        exit_code=int(exit_code) if state == "exited" and exit_code is not None else None,
        runtime_id=str(attrs.get("Id", "")),
        identity=labels.identity,
        since=since[state] or created,
    )
    return Container(
        info,
        str(name).lstrip("/") if name else None,
        labels.stop_timeout,
        started=parse_time(started),
    )


def retryable(exc: BaseException) -> bool:
    text = str(exc).lower()
    if any(marker in text for marker in _PERMANENT):
        return False
    if isinstance(exc, APIError):
        status = exc.status_code
        return status is None or status >= 500 or status in (408, 409, 423, 429)
    return True  # connection trouble, timeouts, a broken stream


def describe(exc: BaseException) -> str:
    if isinstance(exc, APIError) and exc.explanation:
        return f"podman: {exc.explanation}"
    return f"podman: {type(exc).__name__}: {exc}"


VOLUME_LIST_ATTEMPTS: Final = 5


def list_volumes(client: PodmanClient, label: str) -> list[Any]:
    """The volumes with ``label``. Podman 4.3 answers a volume list 500 "no such volume" when
    one of the volumes it matched is removed while it reads them (another delete, in flight):
    the list is asked again, as each answer is a fresh read, up to VOLUME_LIST_ATTEMPTS times."""
    for attempt in range(1, VOLUME_LIST_ATTEMPTS + 1):
        try:
            return list(client.volumes.list(filters=[f"label={label}"]))
        except APIError as exc:
            if "no such volume" not in str(exc) or attempt == VOLUME_LIST_ATTEMPTS:
                raise
    raise AssertionError("unreachable")
