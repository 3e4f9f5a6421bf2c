"""The Podman driver: one container per generation, a named volume per incarnation.

It talks to the Podman REST API with the ``podman`` package. That package is synchronous, so
every call runs in a worker thread (the driver's own pools of daemon threads, so a call still
blocked in Podman when the driver is closed never holds up the process's exit) and the event
stream is read by a dedicated thread feeding an ``asyncio.Queue``: nothing here blocks the
event loop. This module is the asynchronous driver (pools, one call of a key at a time, the
watch loop); the rest of the driver is in its own modules (docs/drivers.md):

- ``podman_calls``: the blocking halves of the operations (launch, stop, kill, delete, reads);
- ``podman_objects``: names, a container as read back, Podman's statuses and errors;
- ``podman_spec``: the create arguments and the confinement (limits, privileges, read-only root);
- ``podman_secrets``: the provider values as mounted Podman secrets and their wrapper;
- ``podman_checkpoint``, ``podman_memory``: a suspend's memory checkpoint (CRIU), kept and
  restored on resume;
- ``podman_events``: events and listings mapped to observations;
- ``podman_stream``: the event stream's reader thread;
- ``podman_execs``, ``podman_exec``, ``podman_runc``, ``podman_exec_end``: exec through
  Podman's API or runc directly (``exec_mode``), the remembered containers, and ending an exec
  left early.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from uuid import UUID

from drivers.daemon_pool import DaemonThreadPool
from drivers.podman_calls import PodmanCalls, running_id
from drivers.podman_checkpoint import Checkpoints
from drivers.podman_events import (
    SentAgain,
    observation_from_event,
    removed_while_away,
    snapshot_from_list,
)
from drivers.podman_exec_end import EXEC_GRACE
from drivers.podman_execs import PodmanExecs
from drivers.podman_objects import (
    ACTOR,
    BACKEND_ERRORS,
    container_name,
    describe,
    remove_volume,
    retryable,
    volume_name,
)
from drivers.podman_runc import RUNC_ROOT, ExecMode
from drivers.podman_spec import DEFAULT_LIMITS, DEFAULT_STOP_TIMEOUT
from drivers.podman_stream import EventStream
from drivers.protocol import (
    DriverError,
    ExecEvent,
    Incarnation,
    LaunchResult,
    LaunchSpec,
    OpResult,
    RuntimeInfo,
    WatchObservation,
)
from events.backoff import Backoff
from events.common import SandboxResources
from events.observations import RuntimeRemoved, RuntimeSnapshot

# The names callers use beside the driver (tests, benchmarks), where they always were.
__all__ = ["DEFAULT_LIMITS", "PodmanDriver", "container_name", "remove_volume", "volume_name"]

log = logging.getLogger("sandstream.drivers.podman")

T = TypeVar("T")


class PodmanDriver:
    """The driver for a Podman API service (``podman system service``)."""

    # An exec's env goes in the session's body (or runc's 0600 process file), never in argv or
    # a URL: a claim's env and provider values may go that way (protocol's exec_env_refusal).
    exec_env_refusal: ClassVar[str | None] = None

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
        exec_grace: float = EXEC_GRACE,
        checkpoint_dir: Path | None = None,
        exec_mode: ExecMode = "auto",
        runc_root: Path = RUNC_ROOT,
    ) -> None:
        self.base_url = base_url
        # How an exec reaches the container: runc directly or Podman's exec API.
        self.execs = PodmanExecs(
            base_url, mode=exec_mode, runc_root=runc_root, request_timeout=request_timeout,
            grace=exec_grace, running=self._running_id,
        )  # fmt: skip
        self.exec_grace = exec_grace  # an exec left early: seconds from SIGTERM to SIGKILL
        self.stop_timeout = float(stop_timeout)
        self.actor = actor
        # An init process (catatonit) as PID 1 forwards SIGTERM to the entrypoint, which a
        # PID 1 without a handler would ignore. Off only to measure the difference (bench).
        self.init = init
        self.limits = limits
        self._request_timeout = request_timeout
        # Set: a suspend keeps the agent's memory (drivers/podman_checkpoint.py).
        checkpoints = Checkpoints(checkpoint_dir) if checkpoint_dir is not None else None
        self._sync = PodmanCalls(
            base_url, stop_timeout=self.stop_timeout, request_timeout=request_timeout, init=init,
            limits=limits, checkpoints=checkpoints,
        )  # fmt: skip
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
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._streams: set[EventStream] = set()
        self._closed = False

    # -- the protocol ------------------------------------------------------------------------

    async def launch(self, spec: LaunchSpec) -> LaunchResult:
        result = await self._call(
            self._sync.launch, spec, key=spec.key, generation=spec.generation, what="launch"
        )
        # Its execs (a claim's first, in a pool member) need not look the container up.
        self.execs.remember(spec.key, spec.generation, result.runtime_id)
        return result

    async def stop(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        return await self._call(
            self._sync.stop, key, generation, timeout, key=key, generation=generation, what="stop"
        )

    async def suspend(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        return await self._call(
            self._sync.suspend, key, generation, timeout, key=key, generation=generation,
            what="suspend",
        )  # fmt: skip

    async def kill(self, key: str, generation: int) -> OpResult:
        # Not exclusive: the key's lock may be held by the very stop this kill is forcing.
        return await self._call(
            self._sync.kill, key, generation, key=key, generation=generation, what="kill",
            exclusive=False,
        )  # fmt: skip

    async def delete(self, key: str, sandbox_id: UUID | None = None) -> bool:
        return await self._call(
            self._sync.delete, key, sandbox_id, key=key, generation=None, what="delete"
        )

    async def get(self, key: str) -> builtins.list[RuntimeInfo]:
        found = await self._call(
            self._sync.list, key, key=key, generation=None, what="get", exclusive=False
        )
        return [c.info for c in found]

    async def list(self) -> builtins.list[RuntimeInfo]:
        found = await self._call(
            self._sync.list, None, key=None, generation=None, what="list", exclusive=False
        )
        return [c.info for c in found]

    async def incarnations(self) -> builtins.set[Incarnation]:
        """The HoldingsDriver capability: incarnations with a container or a volume."""
        return await self._call(
            self._sync.incarnations, key=None, generation=None, what="list", exclusive=False
        )

    async def watch(self) -> AsyncIterator[WatchObservation]:
        """Full listing, then events; after a broken stream, reconnect and list again.

        The event stream is opened before the listing, so nothing that happens in between is
        lost (it follows the listing, possibly as a duplicate). Runtimes seen before a
        reconnect but missing from the new listing are reported removed (source="list"); what
        Podman sends again (an event reported already, a start it knows of) is skipped.
        """
        known: dict[str, tuple[str, int]] = {}  # runtime id -> (key, generation)
        had = SentAgain()
        backoff = Backoff(self._reconnect_delay, self._max_reconnect_delay, log, "podman watch")
        while not self._closed:
            stream = EventStream(self.base_url, asyncio.get_running_loop())
            self._streams.add(stream)
            try:
                try:
                    stream.start()
                    await stream.connected()
                    listing = await self._in_thread(self._sync.list, None)
                except BACKEND_ERRORS as exc:
                    if self._closed:
                        return
                    await asyncio.sleep(backoff.failed(f"cannot connect ({exc})"))
                    continue
                backoff.succeeded()
                listed = {c.info.runtime_id: (c.info.key, c.info.generation) for c in listing}
                for container in listing:
                    yield self.execs.note(snapshot_from_list(container, actor=self.actor))
                for runtime_id, (key, generation) in known.items():
                    if runtime_id not in listed:
                        yield self.execs.note(
                            removed_while_away(runtime_id, key, generation, actor=self.actor)
                        )
                known = listed
                had.listed(listing)
                while (event := await stream.next_event()) is not None:
                    observation = await self._observation(event)
                    if observation is None or had.seen(observation):
                        continue
                    runtime_id = observation.runtime_id or ""
                    if isinstance(observation, RuntimeRemoved):
                        known.pop(runtime_id, None)
                    else:
                        known[runtime_id] = (observation.key, observation.generation)
                    yield self.execs.note(observation)
                if not self._closed:
                    log.warning("podman watch: event stream ended (%s); reconnecting", stream.error)
            finally:
                stream.close()
                self._streams.discard(stream)

    async def close(self) -> None:
        self._closed = True
        for stream in builtins.list(self._streams):
            stream.close()
        self._sync.close()
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
            self._sync.exec,
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
        stdin: bytes | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        """The ExecDriver capability, streamed: through runc or Podman's exec API
        (drivers/podman_execs.py)."""
        events = self.execs.stream(key, generation, command, env=env, workdir=workdir, stdin=stdin)
        async with contextlib.aclosing(events):  # closed with this one: the command ends now
            async for event in events:
                yield event

    async def _running_id(self, key: str, generation: int) -> str:
        """The generation's running container (podman_calls.running_id)."""
        found = await self._call(
            running_id, self._sync, key, generation, key=key, generation=None, what="exec",
            exclusive=False,
        )  # fmt: skip
        if found is None:
            raise DriverError(f"no running runtime of {key} generation {generation}",
                              retryable=False)  # fmt: skip
        return found

    # -- plumbing ----------------------------------------------------------------------------

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking read in the driver's read pool (like asyncio.to_thread)."""
        return await asyncio.get_running_loop().run_in_executor(self._reads, fn, *args)

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
        except BACKEND_ERRORS as exc:
            error = DriverError(f"{what} failed: {describe(exc)}", retryable=retryable(exc))
            if exclusive:
                await self._add_observed(error, key, generation)
            raise error from exc

    async def _exclusive(self, key: str, fn: Callable[..., T], *args: Any) -> T:
        lock = self._locks.setdefault(key, asyncio.Lock())  # kept while someone holds it
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
                self._sync.observe, key, generation
            )
        except BACKEND_ERRORS as exc:
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
                code = await self._in_thread(self._sync.exit_code, observation.runtime_id)
            except BACKEND_ERRORS:
                code = None
            if code is not None:
                observation = observation.model_copy(update={"exit_code": code})
        return observation
