"""The Podman driver: one container per generation, a named volume per incarnation.

It talks to the Podman REST API with the ``podman`` package. That package is synchronous, so
every call runs in a worker thread (the driver's own pools of daemon threads, so a call still
blocked in Podman when the driver is closed never holds up the process's exit) and the event
stream is read by a dedicated thread feeding an ``asyncio.Queue``: nothing here blocks the
event loop.

Naming (see docs/drivers.md):

- container ``sandstream-<key>-g<generation>``, labelled with ``io.sandstream.managed-by``,
  ``.key``, ``.sandbox-id``, ``.generation`` and ``.identity`` (and ``.stop-timeout`` when
  the spec sets ``stop_timeout_seconds``: stop and delete use it as the grace period); env
  ``SANDSTREAM_IDENTITY``;
- volume ``sandstream-<key>-<first 12 hex of sandbox_id>`` at ``/workspace``, kept across stop
  and start of one incarnation, removed on delete; a re-created sandbox gets a new one;
- ``init=True`` (catatonit as PID 1), so SIGTERM stops the sandbox promptly;
- confined by default: memory, CPU and pids limits (the spec's ``resources``, else the
  driver's defaults), no new privileges, every capability dropped, a read-only root with
  writable tmpfs mounts (unless the spec sets ``read_only_root=False``, or the sandbox has
  provider credentials: Podman 4.3 cannot mount secrets into a read-only root), no core dumps.
- the attached providers' values as Podman secrets ``sandstream-<key>-g<generation>--<NAME>``,
  created for the generation and removed with its container. They are mounted as files under
  ``/run/secrets/sandstream/`` and a ``/bin/sh`` wrapper exports each as an environment
  variable before it execs the command: Podman before 5.3 shows the values of ``type=env``
  secrets in ``podman inspect`` (containers/podman#23788), mounted ones it does not.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import logging
import math
import re
import socket
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, TypeVar
from uuid import UUID

from podman import PodmanClient
from podman.api import prepare_filters
from podman.errors import APIError, NotFound, PodmanError

from drivers import podman_exec
from drivers.daemon_pool import DaemonThreadPool
from drivers.protocol import (
    IDENTITY_ENV,
    LABEL_GENERATION,
    LABEL_IDENTITY,
    LABEL_KEY,
    LABEL_MANAGED_BY,
    LABEL_SANDBOX_ID,
    LABEL_STOP_TIMEOUT,
    MANAGED_BY,
    WORKSPACE_PATH,
    DriverError,
    ExecEvent,
    LaunchResult,
    LaunchSpec,
    OpResult,
    RuntimeInfo,
    WatchObservation,
    grace_period,
)
from events.common import SANDBOX_NAME_PATTERN, SandboxResources, SandboxSpec
from events.observations import ObservedState, RuntimeRemoved, RuntimeSnapshot, RuntimeState

log = logging.getLogger("sandstream.drivers.podman")

T = TypeVar("T")

ACTOR: Final = "podman-watcher"
# The container events that change what a sandbox looks like; the rest (init, cleanup, kill,
# exec, exec_died, attach, ...) are ignored.
EVENT_STATES: Final[Mapping[str, RuntimeState]] = {
    "create": "created",
    "start": "running",
    "died": "exited",
}
EVENT_REMOVE: Final = "remove"

# Podman container statuses -> the three states of the protocol. "stopping" still has a
# process; "stopped" has none but is not cleaned up yet; "removing" is on its way out.
_STATES: Final[Mapping[str, RuntimeState]] = {
    "created": "created",
    "configured": "created",
    "initialized": "created",
    "running": "running",
    "paused": "running",
    "stopping": "running",
    "stopped": "exited",
    "exited": "exited",
    "dead": "exited",
    "removing": "exited",
}
_KEY = re.compile(SANDBOX_NAME_PATTERN)
LABEL_PREFIX: Final = "io.sandstream."
# Errors a retry cannot fix, as Podman 4.3 words them (it answers most failures with a 500).
_PERMANENT = ("image not known", "invalid reference format", "executable file not found")


def container_name(key: str, generation: int) -> str:
    return f"sandstream-{key}-g{generation}"


def secret_prefix(key: str, generation: int) -> str:
    return container_name(key, generation) + "--"


SECRETS_DIR: Final = "/run/secrets/sandstream"
# Exports every mounted secret file as a variable named after it, then runs the command.
# (``$(cat ...)`` drops trailing newlines of a value.)
_EXPORT_SECRETS: Final = (
    f'for f in {SECRETS_DIR}/*; do [ -f "$f" ] || continue; '
    'export "${f##*/}=$(cat "$f")"; done; exec "$@"'
)


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


def volume_name(key: str, sandbox_id: UUID) -> str:
    return f"sandstream-{key}-{sandbox_id.hex[:12]}"


def runtime_labels(spec: LaunchSpec) -> dict[str, str]:
    """The sandbox's own labels, then ours. Ours win: the sandbox's labels under our prefix
    (``io.sandstream.``) are dropped, so a spec cannot forge a marker or a stop timeout."""
    labels = {k: v for k, v in spec.spec.labels.items() if not k.startswith(LABEL_PREFIX)}
    labels.update(
        {
            LABEL_MANAGED_BY: MANAGED_BY,
            LABEL_KEY: spec.key,
            LABEL_SANDBOX_ID: str(spec.sandbox_id),
            LABEL_GENERATION: str(spec.generation),
            LABEL_IDENTITY: spec.identity,
        }
    )
    if spec.spec.stop_timeout_seconds is not None:
        labels[LABEL_STOP_TIMEOUT] = str(spec.spec.stop_timeout_seconds)
    return labels


@dataclass(frozen=True, slots=True)
class _Labels:
    key: str
    sandbox_id: UUID | None
    generation: int
    identity: str | None
    stop_timeout: int | None = None  # the sandbox's own grace period, if its spec set one


def _stop_timeout_label(value: str | None) -> int | None:
    try:
        seconds = int(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and seconds >= 0 else None


def parse_labels(labels: Mapping[str, str] | None) -> _Labels | None:
    """Our labels of a container, or None if it is not a (valid) sandstream runtime."""
    if not labels or labels.get(LABEL_MANAGED_BY) != MANAGED_BY:
        return None
    key = labels.get(LABEL_KEY, "")
    try:
        generation = int(labels.get(LABEL_GENERATION, ""))
    except ValueError:
        return None
    if not _KEY.fullmatch(key) or generation < 1:
        return None
    try:
        sandbox_id: UUID | None = UUID(labels.get(LABEL_SANDBOX_ID, ""))
    except ValueError:
        sandbox_id = None
    return _Labels(
        key,
        sandbox_id,
        generation,
        labels.get(LABEL_IDENTITY),
        _stop_timeout_label(labels.get(LABEL_STOP_TIMEOUT)),
    )


def _parse_time(value: object) -> datetime | None:
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


def _from_nanos(nanos: int) -> datetime:
    seconds, rest = divmod(nanos, 1_000_000_000)
    return datetime.fromtimestamp(seconds, UTC) + timedelta(microseconds=rest // 1000)


@dataclass(frozen=True, slots=True)
class _Container:
    """A sandstream container as read from a list or inspect answer."""

    info: RuntimeInfo
    since: datetime | None  # when it entered its current state
    name: str | None
    stop_timeout: int | None = None  # from the stop-timeout label, if any


def _container(attrs: Mapping[str, Any]) -> _Container | None:
    """Parse a list item (State is a string) or an inspect answer (State is a dict)."""
    config = attrs.get("Config") or {}
    labels = parse_labels(attrs.get("Labels") or config.get("Labels"))
    if labels is None or labels.sandbox_id is None:
        return None
    raw_state = attrs.get("State")
    if isinstance(raw_state, Mapping):
        status = str(raw_state.get("Status", ""))
        exit_code = raw_state.get("ExitCode")
        started, finished = raw_state.get("StartedAt"), raw_state.get("FinishedAt")
    else:
        status = str(raw_state or "")
        exit_code = attrs.get("ExitCode")
        started, finished = attrs.get("StartedAt"), attrs.get("ExitedAt")
    state = _STATES.get(status.lower())
    if state is None:
        log.warning("container %s has unknown status %r; skipped", attrs.get("Id"), status)
        return None
    created = _parse_time(attrs.get("Created"))
    since = {"created": created, "running": _parse_time(started), "exited": _parse_time(finished)}
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
    )
    return _Container(
        info,
        since[state] or created,
        str(name).lstrip("/") if name else None,
        labels.stop_timeout,
    )


def snapshot_from_list(container: _Container, *, actor: str = ACTOR) -> RuntimeSnapshot:
    """A source="list" snapshot; its id is stable while the container's state is unchanged."""
    info, since = container.info, container.since
    stamp = int(since.timestamp()) if since else 0
    return RuntimeSnapshot(
        type="RuntimeSnapshot",
        observation_id=f"podman-list:{info.runtime_id}:{info.state}:{stamp}",
        key=info.key,
        generation=info.generation,
        occurred_at=since or datetime.now(UTC),
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
        occurred_at = _from_nanos(nanos)
    else:
        seconds = event.get("time")
        occurred_at = _parse_time(seconds) or datetime.now(UTC)
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


def _retryable(exc: BaseException) -> bool:
    text = str(exc).lower()
    if any(marker in text for marker in _PERMANENT):
        return False
    if isinstance(exc, APIError):
        status = exc.status_code
        return status is None or status >= 500 or status in (408, 409, 423, 429)
    return True  # connection trouble, timeouts, a broken stream


def _describe(exc: BaseException) -> str:
    if isinstance(exc, APIError) and exc.explanation:
        return f"podman: {exc.explanation}"
    return f"podman: {type(exc).__name__}: {exc}"


# Errors from the podman package and the HTTP stack under it (requests' exceptions are
# OSErrors, and so are socket errors): these become DriverErrors; anything else is a bug.
_BACKEND_ERRORS: Final = (PodmanError, OSError)
# Seconds a stop waits after SIGTERM before SIGKILL, unless the caller or the sandbox says.
DEFAULT_STOP_TIMEOUT: Final = 10.0
# A sandbox's limits when its spec sets none (SandboxSpec.resources).
DEFAULT_LIMITS: Final = SandboxResources(memory_mib=1024, cpu_millicores=1000, pids=512)
TMPFS_PATHS: Final = ("/tmp", "/var/tmp", "/run")
CPU_PERIOD_US: Final = 100_000  # the CFS period the CPU quota is a share of
# Set explicitly because passing any ulimit replaces the service's default_ulimits (and
# limits above the machine's hard limits make runc fail).
ULIMITS: Final = (
    {"Name": "core", "Soft": 0, "Hard": 0},
    {"Name": "nofile", "Soft": 1024, "Hard": 1024},
    {"Name": "nproc", "Soft": 1024, "Hard": 1024},
)


def confinement(spec: SandboxSpec, defaults: SandboxResources = DEFAULT_LIMITS) -> dict[str, Any]:
    """The create arguments that confine a runtime: limits and privileges."""
    own = spec.resources or SandboxResources()
    memory = own.memory_mib or defaults.memory_mib
    cpu = own.cpu_millicores or defaults.cpu_millicores
    pids = own.pids or defaults.pids
    args: dict[str, Any] = {
        "no_new_privileges": True,
        "cap_drop": ["ALL"],
        "read_only": spec.read_only_root is not False,
        # Writable scratch space on a read-only root (the API does not add it by itself).
        "mounts": [
            {"type": "tmpfs", "source": "tmpfs", "target": path, "size": "64m"}
            for path in TMPFS_PATHS
        ],
        "ulimits": [dict(u) for u in ULIMITS],
    }
    if memory is not None:
        args["mem_limit"] = memory * 1024 * 1024
    if cpu is not None:
        args["cpu_period"] = CPU_PERIOD_US
        args["cpu_quota"] = cpu * CPU_PERIOD_US // 1000
    if pids is not None:
        args["pids_limit"] = pids
    return args


class PodmanDriver:
    """The driver for a Podman API service (``podman system service``)."""

    def __init__(
        self,
        base_url: str,
        *,
        stop_timeout: float = DEFAULT_STOP_TIMEOUT,
        actor: str = ACTOR,
        request_timeout: float = 60.0,
        reconnect_delay: float = 0.2,
        max_reconnect_delay: float = 5.0,
        max_workers: int = 1024,
        read_workers: int = 8,
        init: bool = True,
        limits: SandboxResources = DEFAULT_LIMITS,
    ) -> None:
        self.base_url = base_url
        self.stop_timeout = float(stop_timeout)
        self.actor = actor
        # An init process (catatonit) as PID 1 forwards SIGTERM to the entrypoint, which a
        # PID 1 without a handler would ignore. Off only to measure the difference (bench).
        self.init = init
        self.limits = limits
        self._request_timeout = request_timeout
        self._reconnect_delay = reconnect_delay
        self._max_reconnect_delay = max_reconnect_delay
        # Podman calls block their thread (a stop for up to the grace period): pools of our
        # own, so slow stops cannot use up the loop's default executor. Launch, stop and
        # delete get a thread each (the executor bounds them: shared slots for fast calls, a
        # lane per caller for slow ones), so a sandbox waiting out its grace period holds no
        # thread another one needs; reads (list, get, the watcher's listing, exec) have their
        # own small pool and never queue behind lifecycle calls. Daemon threads: a call still
        # blocked when the driver is closed (a stop waiting out its grace period) does not
        # hold up the process's exit; Podman finishes it by itself.
        self._executor = DaemonThreadPool(max_workers, thread_name_prefix="podman-call")
        self._reads = DaemonThreadPool(read_workers, thread_name_prefix="podman-read")
        self._local = threading.local()
        self._clients: builtins.list[PodmanClient] = []
        self._clients_lock = threading.Lock()
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._streams: set[_EventStream] = set()
        self._closed = False

    # -- the protocol ------------------------------------------------------------------------

    async def launch(self, spec: LaunchSpec) -> LaunchResult:
        return await self._call(
            self._launch_sync, spec, key=spec.key, generation=spec.generation, what="launch"
        )

    async def stop(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        return await self._call(
            self._stop_sync, key, generation, timeout, key=key, generation=generation, what="stop"
        )

    async def kill(self, key: str, generation: int) -> OpResult:
        # Not exclusive: the key's lock may be held by the very stop this kill is forcing.
        return await self._call(
            self._kill_sync, key, generation, key=key, generation=generation, what="kill",
            exclusive=False,
        )  # fmt: skip

    async def delete(self, key: str, sandbox_id: UUID | None = None) -> bool:
        return await self._call(
            self._delete_sync, key, sandbox_id, key=key, generation=None, what="delete"
        )

    async def get(self, key: str) -> builtins.list[RuntimeInfo]:
        found = await self._call(
            self._list_sync, key, key=key, generation=None, what="get", exclusive=False
        )
        return [c.info for c in found]

    async def list(self) -> builtins.list[RuntimeInfo]:
        found = await self._call(
            self._list_sync, None, key=None, generation=None, what="list", exclusive=False
        )
        return [c.info for c in found]

    async def watch(self) -> AsyncIterator[WatchObservation]:
        """Full listing, then events; after a broken stream, reconnect and list again.

        The event stream is opened before the listing, so nothing that happens in between is
        lost (it follows the listing, possibly as a duplicate). Runtimes seen before a
        reconnect but missing from the new listing are reported removed (source="list").
        """
        known: dict[str, tuple[str, int]] = {}  # runtime id -> (key, generation)
        delay = self._reconnect_delay
        while not self._closed:
            stream = _EventStream(self.base_url, asyncio.get_running_loop())
            self._streams.add(stream)
            try:
                try:
                    stream.start()
                    await stream.connected()
                    listing = await self._in_thread(self._list_sync, None)
                except _BACKEND_ERRORS as exc:
                    if self._closed:
                        return
                    log.warning("podman watch: cannot connect (%s); retrying in %.1fs", exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self._max_reconnect_delay)
                    continue
                delay = self._reconnect_delay
                listed = {c.info.runtime_id: (c.info.key, c.info.generation) for c in listing}
                for container in listing:
                    yield snapshot_from_list(container, actor=self.actor)
                for runtime_id, (key, generation) in known.items():
                    if runtime_id not in listed:
                        yield self._removed_while_away(runtime_id, key, generation)
                known = listed
                while (event := await stream.next_event()) is not None:
                    observation = await self._observation(event)
                    if observation is None:
                        continue
                    runtime_id = observation.runtime_id or ""
                    if isinstance(observation, RuntimeRemoved):
                        known.pop(runtime_id, None)
                    else:
                        known[runtime_id] = (observation.key, observation.generation)
                    yield observation
                if not self._closed:
                    log.warning("podman watch: event stream ended (%s); reconnecting", stream.error)
            finally:
                stream.close()
                self._streams.discard(stream)

    async def close(self) -> None:
        self._closed = True
        for stream in builtins.list(self._streams):
            stream.close()
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()  # type: ignore[no-untyped-call]
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._reads.shutdown(wait=False, cancel_futures=True)

    # -- extras ------------------------------------------------------------------------------

    @property
    def connected_watchers(self) -> int:
        """Watch streams whose event stream is open: from then on no event is missed."""
        return sum(1 for stream in self._streams if stream.is_connected)

    def reconnect_watchers(self) -> None:
        """Break every open event stream: watchers reconnect and list again (as after a
        Podman restart). For tests and operators."""
        for stream in builtins.list(self._streams):
            stream.interrupt()

    async def exec(self, key: str, generation: int, command: builtins.list[str]) -> tuple[int, str]:
        """Run ``command`` in the generation's runtime: (exit code, stdout + stderr)."""
        return await self._call(
            self._exec_sync,
            key,
            generation,
            command,
            key=key,
            generation=generation,
            what="exec",
            exclusive=False,
        )

    async def exec_stream(
        self,
        key: str,
        generation: int,
        command: builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        """The ExecDriver capability: Podman's exec API, streamed (see drivers/podman_exec.py)."""
        found = await self._call(
            self._list_sync, key, None, generation, key=key, generation=None, what="exec",
            exclusive=False,
        )  # fmt: skip
        if not found or found[-1].info.state != "running":
            raise DriverError(f"no running runtime of {key} generation {generation}",
                              retryable=False)  # fmt: skip
        runtime_id = found[-1].info.runtime_id
        async for event in podman_exec.exec_stream(
            self.base_url, runtime_id, command, env=env, workdir=workdir,
            request_timeout=self._request_timeout,
        ):  # fmt: skip
            yield event

    # -- plumbing ----------------------------------------------------------------------------

    def _lock(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking read in the driver's read pool (like asyncio.to_thread)."""
        return await asyncio.get_running_loop().run_in_executor(self._reads, fn, *args)

    def _client(self) -> PodmanClient:
        """One client per worker thread (a requests session is not meant to be shared)."""
        client: PodmanClient | None = getattr(self._local, "client", None)
        if client is None:
            client = PodmanClient(base_url=self.base_url, timeout=self._request_timeout)
            self._local.client = client
            with self._clients_lock:
                self._clients.append(client)
        return client

    async def _call(
        self,
        fn: Callable[..., T],
        *args: Any,
        key: str | None,
        generation: int | None,
        what: str,
        exclusive: bool = True,
    ) -> T:
        """Run ``fn`` in a worker thread; backend errors become DriverErrors.

        ``exclusive`` calls of one key run one at a time, in arrival order. A cancelled call
        keeps its key until its thread has really finished (a Podman call cannot be called
        back), so the next call of that key never overlaps it.
        """
        try:
            if exclusive and key is not None:
                return await self._exclusive(key, fn, *args)
            return await self._in_thread(fn, *args)
        except DriverError as exc:
            if exclusive:
                await self._add_observed(exc, key, generation)
            raise
        except _BACKEND_ERRORS as exc:
            error = DriverError(f"{what} failed: {_describe(exc)}", retryable=_retryable(exc))
            if exclusive:
                await self._add_observed(error, key, generation)
            raise error from exc

    async def _exclusive(self, key: str, fn: Callable[..., T], *args: Any) -> T:
        lock = self._lock(key)
        await lock.acquire()
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except BaseException:
            lock.release()
            raise
        future.add_done_callback(lambda _: lock.release())
        return await asyncio.shield(future)

    async def _add_observed(
        self, error: DriverError, key: str | None, generation: int | None
    ) -> None:
        """Fill in what the backend looks like after a failure, if the error does not say."""
        if error.observed is not None or key is None:
            return
        try:
            error.observed, error.exit_code = await self._in_thread(
                self._observe_sync, key, generation
            )
        except _BACKEND_ERRORS as exc:
            log.info("cannot observe %s after a failure: %s", key, exc)

    async def _observation(self, event: Mapping[str, Any]) -> WatchObservation | None:
        observation = observation_from_event(event, actor=self.actor)
        if (
            isinstance(observation, RuntimeSnapshot)
            and observation.state == "exited"
            and observation.exit_code is None
            and observation.runtime_id
        ):
            # The event lacked the exit code: ask the container (if it still exists).
            try:
                code = await self._in_thread(self._exit_code_sync, observation.runtime_id)
            except _BACKEND_ERRORS:
                code = None
            if code is not None:
                observation = observation.model_copy(update={"exit_code": code})
        return observation

    def _removed_while_away(self, runtime_id: str, key: str, generation: int) -> RuntimeRemoved:
        """A runtime known before a reconnect and missing from the new listing."""
        return RuntimeRemoved(
            type="RuntimeRemoved",
            observation_id=f"podman-list:{runtime_id}:removed",
            key=key,
            generation=generation,
            occurred_at=datetime.now(UTC),
            actor=self.actor,
            runtime_id=runtime_id,
            source="list",
        )

    # -- synchronous halves (worker threads only) --------------------------------------------

    def _list_sync(
        self, key: str | None, sandbox_id: UUID | None = None, generation: int | None = None
    ) -> builtins.list[_Container]:
        """Our containers (of ``key``, of one incarnation, of one generation), sorted."""
        # One label filter on the server (the most selective); the rest is checked here.
        label = f"{LABEL_KEY}={key}" if key is not None else f"{LABEL_MANAGED_BY}={MANAGED_BY}"
        listed = self._client().containers.list(all=True, filters=[f"label={label}"])
        found = [_container(c.attrs) for c in listed]
        return sorted(
            (
                c
                for c in found
                if c is not None
                and key in (None, c.info.key)
                and sandbox_id in (None, c.info.sandbox_id)
                and generation in (None, c.info.generation)
            ),
            key=lambda c: (c.info.key, c.info.generation, c.info.runtime_id),
        )

    def _volumes_sync(self, key: str, sandbox_id: UUID | None) -> builtins.list[str]:
        """Our workspace volumes of ``key`` (of one incarnation).

        Podman 4.3 ORs several label filters on volumes (it ANDs them on containers), so
        the server filters on the key label alone and the rest is checked here.
        """
        listed = self._client().volumes.list(filters=[f"label={LABEL_KEY}={key}"])
        names = []
        for volume in listed:
            labels = volume.attrs.get("Labels") or {}
            if (
                labels.get(LABEL_MANAGED_BY) == MANAGED_BY
                and labels.get(LABEL_KEY) == key
                and (sandbox_id is None or labels.get(LABEL_SANDBOX_ID) == str(sandbox_id))
            ):
                names.append(str(volume.name))
        return sorted(names)

    def _launch_sync(self, spec: LaunchSpec) -> LaunchResult:
        client = self._client()
        existing = self._list_sync(spec.key)
        newer = [c for c in existing if c.info.generation > spec.generation]
        if newer:
            newest = newer[-1].info
            raise DriverError(
                f"launch of generation {spec.generation} superseded: generation "
                f"{newest.generation} of {spec.key} exists",
                retryable=False,
                observed=newest.state,
                exit_code=newest.exit_code,
            )
        current: RuntimeInfo | None = None
        for container in existing:
            info = container.info
            if info.generation < spec.generation:
                self._stop_and_remove_sync(info.runtime_id, self._grace(container))
                self._remove_secrets_sync(info.key, info.generation)
            elif info.identity != spec.identity or info.sandbox_id != spec.sandbox_id:
                # Launched for another intent (cannot happen through the processor, which mints
                # identity and generation together): converge to the persisted identity.
                log.warning("replacing %s: it has another identity or incarnation", info.runtime_id)
                self._stop_and_remove_sync(info.runtime_id, self._grace(container))
                self._remove_secrets_sync(info.key, info.generation)
            else:
                current = info
        if current is not None and current.state == "exited":
            # It ran and was stopped (or ended): starting it again would resurrect a
            # generation the row has moved past. A new run is a new generation (start).
            raise DriverError(
                f"generation {spec.generation} of {spec.key} already ran and exited: a launch "
                "never starts it again",
                retryable=False,
                observed="exited",
                exit_code=current.exit_code,
            )
        if current is None:
            runtime_id = self._create_sync(spec)
            started = True
        else:
            runtime_id = current.runtime_id
            started = current.state != "running"
        if started:
            client.containers.get(runtime_id).start()
        return LaunchResult(
            runtime_id, spec.generation, spec.identity, started, adopted=current is not None
        )

    def _create_sync(self, spec: LaunchSpec) -> str:
        client = self._client()
        volume = volume_name(spec.key, spec.sandbox_id)
        try:
            client.volumes.get(volume)
        except NotFound:
            try:
                client.volumes.create(
                    volume,
                    labels={
                        LABEL_MANAGED_BY: MANAGED_BY,
                        LABEL_KEY: spec.key,
                        LABEL_SANDBOX_ID: str(spec.sandbox_id),
                    },
                )
            except APIError as exc:
                if "already exists" not in str(exc):
                    raise
        name = container_name(spec.key, spec.generation)
        args: dict[str, Any] = {
            "name": name,
            "hostname": spec.key,
            "labels": runtime_labels(spec),
            "environment": {**spec.spec.env, IDENTITY_ENV: spec.identity},
            "init": self.init,
            # Podman's own default for `podman stop` by hand; sandstream always passes the
            # grace period explicitly (see _grace).
            "stop_timeout": math.ceil(
                grace_period(None, spec.spec.stop_timeout_seconds, self.stop_timeout)
            ),
            "volumes": {volume: {"bind": WORKSPACE_PATH, "mode": "rw"}},
            **confinement(spec.spec, self.limits),
        }
        if spec.spec.command:
            args["command"] = builtins.list(spec.spec.command)
        if spec.secrets:
            self._add_secrets_sync(spec, args)
        try:
            return str(client.containers.create(spec.spec.image, **args).id)
        except APIError as exc:
            if "already in use" not in str(exc):
                raise
        # The name is taken: by a concurrent launch of the same generation, or by a stranger.
        attrs = client.containers.get(name).attrs
        container = _container(attrs)
        if container is None or container.info.generation != spec.generation:
            raise DriverError(
                f"container name {name} is in use by a container sandstream does not manage",
                retryable=False,
            )
        return container.info.runtime_id

    def _add_secrets_sync(self, spec: LaunchSpec, args: dict[str, Any]) -> None:
        """Create this generation's secrets and the wrapper that exports them (see the module
        docstring); the command becomes the image's entrypoint and command, or the spec's."""
        client = self._client()
        prefix = secret_prefix(spec.key, spec.generation)
        self._remove_secrets_sync(spec.key, spec.generation)  # left by an interrupted launch
        mounts = []
        for env_name, value in sorted(spec.secrets.items()):
            client.secrets.create(prefix + env_name, value.encode())
            mounts.append(
                {"source": prefix + env_name, "target": f"{SECRETS_DIR}/{env_name}", "mode": 0o400}
            )
        config = client.images.get(spec.spec.image).attrs.get("Config") or {}
        argv = builtins.list(config.get("Entrypoint") or []) + builtins.list(
            spec.spec.command or config.get("Cmd") or []
        )
        args["secrets"] = mounts
        # Podman 4.3 mounts secrets before the tmpfs mounts, and cannot create their target in
        # a read-only root: a sandbox with credentials gets a writable root (docs/drivers.md).
        args["read_only"] = False
        args["entrypoint"] = ["/bin/sh", "-c", _EXPORT_SECRETS, "sandstream-env"]
        args["command"] = argv

    def _remove_secrets_sync(self, key: str, generation: int) -> None:
        client = self._client()
        prefix = secret_prefix(key, generation)
        for secret in client.secrets.list():
            if str(secret.name).startswith(prefix):
                with contextlib.suppress(NotFound):
                    client.secrets.remove(secret.id)

    def _grace(self, container: _Container, timeout: float | None = None) -> float:
        """The grace period for stopping ``container`` (its own is its stop-timeout label)."""
        return grace_period(timeout, container.stop_timeout, self.stop_timeout)

    def _stop_sync(self, key: str, generation: int, timeout: float | None) -> OpResult:
        found = self._list_sync(key, generation=generation)
        if not found:
            return OpResult("already_absent")
        info = found[-1].info
        grace = self._grace(found[-1], timeout)
        if info.state == "running" and not self._stop_container_sync(info.runtime_id, grace):
            return OpResult("already_absent")
        exit_code = self._exit_code_sync(info.runtime_id) if info.state != "created" else None
        return OpResult("succeeded", info.runtime_id, exit_code)

    def _kill_sync(self, key: str, generation: int) -> OpResult:
        found = self._list_sync(key, generation=generation)
        if not found:
            return OpResult("already_absent")
        info = found[-1].info
        if info.state == "running":
            response = self._client().api.post(
                f"/containers/{info.runtime_id}/kill",
                params={"signal": "SIGKILL"},
                timeout=self._request_timeout,
            )
            if response.status_code == 404:
                return OpResult("already_absent")
            # Refused when it stopped in between ("container state improper"): that is fine.
            if response.status_code != 204 and self._running_sync(info.runtime_id):
                response.raise_for_status()
                raise APIError(f"unexpected status {response.status_code} from kill")
        return OpResult("succeeded", info.runtime_id, self._exit_code_sync(info.runtime_id))

    def _running_sync(self, runtime_id: str) -> bool:
        try:
            attrs = self._client().containers.get(runtime_id).attrs
        except NotFound:
            return False
        container = _container(attrs)
        return container is not None and container.info.state == "running"

    def _delete_sync(self, key: str, sandbox_id: UUID | None) -> bool:
        containers = self._list_sync(key, sandbox_id)
        for container in containers:
            self._stop_and_remove_sync(container.info.runtime_id, self._grace(container))
            self._remove_secrets_sync(container.info.key, container.info.generation)
        volumes = self._volumes_sync(key, sandbox_id)
        client = self._client()
        for volume in volumes:
            remove_volume(client, volume)
        return bool(containers or volumes)

    def _stop_container_sync(self, runtime_id: str, grace: float) -> bool:
        """SIGTERM, then SIGKILL after ``grace`` seconds; False if the container is gone."""
        seconds = max(0, math.ceil(grace))
        response = self._client().api.post(
            f"/containers/{runtime_id}/stop",
            params={"timeout": seconds},
            timeout=seconds * 1.5 + self._request_timeout,
        )
        if response.status_code == 404:
            return False
        if response.status_code not in (204, 304):  # 304: it was not running any more
            response.raise_for_status()
            raise APIError(f"unexpected status {response.status_code} from stop")
        return True

    def _stop_and_remove_sync(self, runtime_id: str, grace: float) -> None:
        if self._stop_container_sync(runtime_id, grace):
            with contextlib.suppress(NotFound):
                self._client().containers.remove(runtime_id, force=True)

    def _exit_code_sync(self, runtime_id: str) -> int | None:
        try:
            attrs = self._client().containers.get(runtime_id).attrs
        except NotFound:
            return None
        container = _container(attrs)
        return container.info.exit_code if container else None

    def _observe_sync(
        self, key: str, generation: int | None
    ) -> tuple[ObservedState | None, int | None]:
        """What the backend looks like now, for a DriverError: the generation's runtime (or
        the newest one), "absent" when nothing of the key is left, None when only its
        workspace is (not absent, not a runtime state either)."""
        found = self._list_sync(key, generation=generation)
        if found:
            info = found[-1].info
            return info.state, info.exit_code
        if generation is None and self._volumes_sync(key, None):
            return None, None
        return "absent", None

    def _exec_sync(self, key: str, generation: int, command: builtins.list[str]) -> tuple[int, str]:
        found = self._list_sync(key, generation=generation)
        if not found:
            raise DriverError(f"no runtime of {key} generation {generation}", retryable=False)
        container = self._client().containers.get(found[-1].info.runtime_id)
        code, output = container.exec_run(command, demux=True)
        out, err = output if isinstance(output, tuple) else (output, None)
        return int(code if code is not None else -1), (out or b"").decode() + (err or b"").decode()


# -- the event stream -------------------------------------------------------------------------


class _Connected:
    """Queue marker: the event stream is open."""


class _Ended:
    """Queue marker: the event stream ended (``error`` says why, None for a clean end)."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class _EventStream:
    """Podman's ``GET /events`` (container events) read by a daemon thread into a queue.

    This is the request ``PodmanClient.events(decode=True, filters={"type": "container"})``
    sends; it is made directly so the stream's socket can be shut down from the event loop,
    which wakes the reading thread at once (closing a pooled session does not).
    """

    def __init__(self, base_url: str, loop: asyncio.AbstractEventLoop) -> None:
        self._base_url = base_url
        self._loop = loop
        self._queue: asyncio.Queue[dict[str, Any] | _Connected | _Ended] = asyncio.Queue()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name="podman-events", daemon=True)
        self.error: BaseException | None = None
        self.is_connected = False

    def start(self) -> None:
        self._thread.start()

    async def connected(self) -> None:
        """Wait until the stream is open; ConnectionError if it could not be opened."""
        item = await self._queue.get()
        if isinstance(item, _Ended):
            self.error = item.error
            raise ConnectionError(f"podman event stream: {item.error or 'closed'}")
        if not isinstance(item, _Connected):  # pragma: no cover - the thread sends it first
            raise ConnectionError(f"podman event stream: unexpected first item {item!r}")
        self.is_connected = True

    async def next_event(self) -> dict[str, Any] | None:
        """The next event, or None once the stream has ended (``error`` says why)."""
        while True:
            item = await self._queue.get()
            if isinstance(item, _Ended):
                self.error = item.error
                self.is_connected = False
                return None
            if isinstance(item, dict):
                return item

    def interrupt(self) -> None:
        """Break the connection; the reader reports the stream as ended."""
        with self._lock:
            response = self._response
        if response is not None:
            _shutdown(response)

    def close(self) -> None:
        """Stop for good: the reader thread ends without reporting, any reader wakes up."""
        self._stopping.set()
        self.interrupt()
        if not self._loop.is_closed():
            self._queue.put_nowait(_Ended(None))

    def _put(self, item: dict[str, Any] | _Connected | _Ended) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._stopping.set()

    def _run(self) -> None:
        client = PodmanClient(base_url=self._base_url)  # no timeout: the stream idles
        response: Any = None
        try:
            response = client.api.get(
                "/events",
                params={"filters": prepare_filters({"type": "container"}), "stream": True},
                stream=True,
            )
            response.raise_for_status()
            with self._lock:
                self._response = response
            if self._stopping.is_set():
                return
            self._put(_Connected())
            for line in response.iter_lines():
                if self._stopping.is_set():
                    return
                if not line:
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    log.warning("podman watch: undecodable event %r", line[:200])
                    continue
                if isinstance(event, dict):
                    self._put(event)
            self._put(_Ended(None))
        except Exception as exc:  # the thread reports every failure to the watcher
            if not self._stopping.is_set():
                self._put(_Ended(exc))
        finally:
            if response is not None:
                # Closing a broken stream may fail; there is nothing left to do then.
                with contextlib.suppress(Exception):
                    response.close()
            client.close()  # type: ignore[no-untyped-call]


def _shutdown(response: Any) -> None:
    """Shut the stream's socket down, which wakes a thread blocked reading it."""
    raw = getattr(response, "raw", None)
    connection = getattr(raw, "connection", None) or getattr(raw, "_connection", None)
    sock = getattr(connection, "sock", None)
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    else:
        with contextlib.suppress(Exception):
            response.close()
