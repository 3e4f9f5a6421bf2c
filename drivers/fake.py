"""An in-memory, deterministic driver for race tests of the executor and the processor.

It behaves like the Podman driver (one runtime per generation, a workspace per incarnation,
idempotent launch, stop/delete safe when absent, a watch stream that starts with a full
listing) and adds hooks a test drives explicitly:

- ``block(op, key)`` holds every call of ``op`` on ``key`` at its start until the returned
  handle's ``release()``; ``await handle.entered()`` waits until a call is being held;
- ``fail(op, key, reason, retryable)`` makes the next call (or ``times`` calls) raise
  :class:`DriverError` after any block;
- ``inject(observation)`` pushes any observation into every watch stream;
- ``runtime_exited(key, generation, exit_code)`` lets a runtime finish on its own;
- ``reconnect_watchers()`` makes every watch stream list everything again, like a watcher that
  lost its event stream;
- ``calls`` records every call in order, with the grace period a stop or delete used (the
  caller's timeout, else the sandbox's ``stop_timeout_seconds``, else the fake's default);
- ``real_grace=True``: a running runtime whose spec carries the label ``IGNORES_SIGTERM``
  (``"true"``) makes a stop or delete really wait out its grace period (asyncio time, no
  thread), then it is killed (exit 137): slow sandboxes with real timing, for head-of-line
  tests and benchmarks.

Nothing here reads the wall clock or randomness unless a ``clock`` is given: runtime ids,
observation ids and timestamps follow from the order of calls.
"""

from __future__ import annotations

import asyncio
import builtins
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import ClassVar, Final, Literal
from uuid import UUID

from drivers.launch_precheck import launch_precheck
from drivers.protocol import (
    DriverError,
    LaunchResult,
    LaunchSpec,
    OpResult,
    RuntimeInfo,
    WatchObservation,
    grace_period,
    observed_state,
)
from events.observations import ObservedState, RuntimeRemoved, RuntimeSnapshot, RuntimeState

FakeOp = Literal["launch", "stop", "suspend", "kill", "delete", "get", "list"]
FAKE_EPOCH: Final = datetime(2025, 1, 1, tzinfo=UTC)
SIGTERM_EXIT_CODE: Final = 143  # what a stopped runtime with an init process exits with
SIGKILL_EXIT_CODE: Final = 137  # what a runtime killed after its grace period exits with
# A spec label that makes the runtime ignore SIGTERM (with real_grace=True).
IGNORES_SIGTERM: Final = "fake.sandstream/ignores-sigterm"


@dataclass(frozen=True, slots=True)
class Call:
    """One recorded driver call."""

    op: FakeOp
    key: str | None
    generation: int | None = None
    spec: LaunchSpec | None = None
    timeout: float | None = None  # as passed by the caller
    sandbox_id: UUID | None = None
    # The grace period a stop or delete used: the caller's timeout, else the sandbox's own
    # stop_timeout_seconds, else the driver's default (for a delete: the longest of its
    # runtimes'); None when there was nothing to stop.
    grace: float | None = None


class BlockHandle:
    """Holds calls of one operation on one key until ``release()``."""

    def __init__(self, op: FakeOp, key: str | None) -> None:
        self.op = op
        self.key = key
        self.held = 0  # calls that reached the block (including ones already released)
        self._gate = asyncio.Event()
        self._entered = asyncio.Event()

    @property
    def released(self) -> bool:
        return self._gate.is_set()

    def release(self) -> None:
        """Let every held call, and every later one, continue."""
        self._gate.set()

    async def entered(self, timeout: float = 5.0) -> None:
        """Wait until at least one call is held here (fails after ``timeout`` seconds)."""
        await asyncio.wait_for(self._entered.wait(), timeout)

    async def _hold(self) -> None:
        self.held += 1
        self._entered.set()
        await self._gate.wait()


@dataclass(slots=True)
class _Failure:
    reason: str
    retryable: bool
    observed: ObservedState | None
    remaining: int | None  # None: until cleared


@dataclass(slots=True)
class _Runtime:
    key: str
    sandbox_id: UUID
    generation: int
    identity: str
    runtime_id: str
    state: RuntimeState
    exit_code: int | None = None
    stop_timeout: int | None = None  # the spec's stop_timeout_seconds
    ignores_sigterm: bool = False
    changed_seq: int = 0  # the sequence number of the last state change
    changed_at: datetime = FAKE_EPOCH
    terminating: ClassVar[bool] = False  # a stop or delete here is instant, never under way

    @property
    def info(self) -> RuntimeInfo:
        return RuntimeInfo(
            key=self.key,
            sandbox_id=self.sandbox_id,
            generation=self.generation,
            state=self.state,
            exit_code=self.exit_code,
            runtime_id=self.runtime_id,
            identity=self.identity,
            since=self.changed_at,
        )

    def snapshot(
        self, observation_id: str, actor: str, source: Literal["watch", "list"]
    ) -> RuntimeSnapshot:
        """Its state, since it entered it."""
        return RuntimeSnapshot(
            type="RuntimeSnapshot",
            observation_id=observation_id,
            key=self.key,
            generation=self.generation,
            occurred_at=self.changed_at,
            actor=actor,
            state=self.state,
            exit_code=self.exit_code,
            runtime_id=self.runtime_id,
            source=source,
        )

    def removal(self, observation_id: str, actor: str, at: datetime) -> RuntimeRemoved:
        """Its removal, seen by a watch at ``at``."""
        return RuntimeRemoved(
            type="RuntimeRemoved",
            observation_id=observation_id,
            key=self.key,
            generation=self.generation,
            occurred_at=at,
            actor=actor,
            runtime_id=self.runtime_id,
            source="watch",
        )


class _Relist:
    """Marker in a watcher queue: list everything again."""


class _Closed:
    """Marker in a watcher queue: the driver closed."""


_Item = WatchObservation | _Relist | _Closed


class _Streams:
    """The open watch streams' queues, and what is injected before the first one opens."""

    def __init__(self) -> None:
        self.queues: builtins.list[asyncio.Queue[_Item]] = []
        self.pending: builtins.list[WatchObservation] = []

    def open(self) -> tuple[asyncio.Queue[_Item], builtins.list[WatchObservation]]:
        """A new stream's queue, and what was injected for it while none was open."""
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.queues.append(queue)
        pending, self.pending = self.pending, []
        return queue, pending

    def put(self, item: _Item) -> None:
        for queue in self.queues:
            queue.put_nowait(item)

    def inject(self, observation: WatchObservation) -> None:
        if self.queues:
            self.put(observation)
        else:
            self.pending.append(observation)


class _Calls:
    """The calls a fake received, in order, and the holds placed on them (``block``)."""

    def __init__(self) -> None:
        self.calls: builtins.list[Call] = []
        self._blocks: dict[tuple[FakeOp, str | None], BlockHandle] = {}

    def block(self, op: FakeOp, key: str | None = None) -> BlockHandle:
        """Hold calls of ``op`` on ``key`` (None: any key) until the handle is released."""
        handle = self._blocks.get((op, key))
        if handle is None or handle.released:
            handle = self._blocks[(op, key)] = BlockHandle(op, key)
        return handle

    def calls_for(self, op: FakeOp | None = None, key: str | None = None) -> builtins.list[Call]:
        return [
            c for c in self.calls if (op is None or c.op == op) and (key is None or c.key == key)
        ]

    async def _enter(self, call: Call) -> None:
        self.calls.append(call)
        for block_key in ((call.op, call.key), (call.op, None)):
            handle = self._blocks.get(block_key)
            if handle is not None and not handle.released:
                await handle._hold()


class FakeDriver(_Calls):
    """The in-memory driver. ``auto_observe=False`` leaves watch streams to ``inject`` alone."""

    def __init__(
        self,
        *,
        actor: str = "fake-watcher",
        auto_observe: bool = True,
        stop_exit_code: int = SIGTERM_EXIT_CODE,
        clock: Callable[[], datetime] | None = None,
        stop_timeout: float = 10.0,
        real_grace: bool = False,
    ) -> None:
        self.actor = actor
        self.real_grace = real_grace
        self.stop_timeout = stop_timeout  # the default grace period, like PodmanDriver's
        self.auto_observe = auto_observe
        self.stop_exit_code = stop_exit_code
        self.clock = clock
        super().__init__()
        self._runtimes: dict[str, dict[int, _Runtime]] = {}
        self._workspaces: set[tuple[str, UUID]] = set()
        self._failures: dict[tuple[FakeOp, str | None], deque[_Failure]] = {}
        self._streams = _Streams()
        self._seq = 0
        self._closed = False

    # -- hooks -------------------------------------------------------------------------------

    def fail(
        self,
        op: FakeOp,
        key: str | None,
        reason: str,
        retryable: bool,
        *,
        times: int | None = 1,
        observed: ObservedState | None = None,
    ) -> None:
        """Make the next ``times`` calls (None: all, until ``clear_failures``) of ``op`` fail.

        ``observed`` defaults to the state the fake is in when the call fails.
        """
        if times is not None and times < 1:
            raise ValueError("times must be at least 1 (or None)")
        failure = _Failure(reason, retryable, observed, times)
        self._failures.setdefault((op, key), deque()).append(failure)

    def clear_failures(self) -> None:
        self._failures.clear()

    def inject(self, observation: WatchObservation) -> None:
        """Deliver ``observation`` to every watch stream (or to the next one, if none runs)."""
        self._streams.inject(observation)

    def reconnect_watchers(self) -> None:
        """Every watch stream lists everything again (source="list"), as after a reconnect."""
        self._streams.put(_Relist())

    def runtime_exited(self, key: str, generation: int, exit_code: int = 0) -> None:
        """The runtime's process ended on its own (it completed or crashed)."""
        runtime = self._runtimes.get(key, {}).get(generation)
        if runtime is None:
            raise KeyError(f"no runtime {key} generation {generation}")
        self._set_state(runtime, "exited", exit_code)

    def stop_timeout_of(self, key: str, generation: int) -> int | None:
        """The stop_timeout_seconds the runtime was launched with (None: the default)."""
        runtime = self._runtimes.get(key, {}).get(generation)
        if runtime is None:
            raise KeyError(f"no runtime {key} generation {generation}")
        return runtime.stop_timeout

    def has_workspace(self, key: str, sandbox_id: UUID | None = None) -> bool:
        return any(k == key and sandbox_id in (None, s) for k, s in self._workspaces)

    @property
    def watcher_count(self) -> int:
        return len(self._streams.queues)

    # -- the protocol ------------------------------------------------------------------------

    async def launch(self, spec: LaunchSpec) -> LaunchResult:
        await self._enter(Call("launch", spec.key, spec.generation, spec=spec))
        self._maybe_fail("launch", spec.key, spec.generation)
        runtimes = self._runtimes.setdefault(spec.key, {})
        plan = launch_precheck(spec, builtins.list(runtimes.values()))
        for runtime in plan.replace:
            self._remove(runtime)
        if plan.refusal is not None:
            raise plan.refusal
        if (current := plan.current) is not None:
            starts = plan.starts
            if starts:
                self._set_state(current, "running", None)
            return LaunchResult(
                current.runtime_id, spec.generation, spec.identity, starts, adopted=True
            )
        self._workspaces.add((spec.key, spec.sandbox_id))
        runtime = _Runtime(
            key=spec.key,
            sandbox_id=spec.sandbox_id,
            generation=spec.generation,
            identity=spec.identity,
            runtime_id=f"fake-{spec.key}-g{spec.generation}-{self._next_seq()}",
            state="created",
            stop_timeout=spec.spec.stop_timeout_seconds,
            ignores_sigterm=spec.spec.labels.get(IGNORES_SIGTERM) == "true",
        )
        runtimes[spec.generation] = runtime
        self._set_state(runtime, "created", None)
        self._set_state(runtime, "running", None)
        return LaunchResult(runtime.runtime_id, spec.generation, spec.identity, True)

    async def stop(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        runtime = self._runtimes.get(key, {}).get(generation)
        grace = self._grace(runtime, timeout) if runtime is not None else None
        await self._enter(Call("stop", key, generation, timeout=timeout, grace=grace))
        self._maybe_fail("stop", key, generation)
        runtime = self._runtimes.get(key, {}).get(generation)
        if runtime is None:
            return OpResult("already_absent")
        if runtime.state == "running":
            self._set_state(runtime, "exited", await self._terminate(runtime, timeout))
        return OpResult("succeeded", runtime.runtime_id, runtime.exit_code)

    async def suspend(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        """Stop and remove the runtimes of ``generation`` and older; the workspace stays."""
        runtime = self._runtimes.get(key, {}).get(generation)
        grace = self._grace(runtime, timeout) if runtime is not None else None
        await self._enter(Call("suspend", key, generation, timeout=timeout, grace=grace))
        self._maybe_fail("suspend", key, generation)
        doomed = [r for g, r in self._runtimes.get(key, {}).items() if g <= generation]
        await self._end(doomed, timeout)
        if not doomed:
            return OpResult("already_absent")
        return OpResult("succeeded", doomed[-1].runtime_id, doomed[-1].exit_code)

    async def kill(self, key: str, generation: int) -> OpResult:
        await self._enter(Call("kill", key, generation))
        self._maybe_fail("kill", key, generation)
        runtime = self._runtimes.get(key, {}).get(generation)
        if runtime is None:
            return OpResult("already_absent")
        if runtime.state == "running":
            self._set_state(runtime, "exited", 137)
        return OpResult("succeeded", runtime.runtime_id, runtime.exit_code)

    async def delete(self, key: str, sandbox_id: UUID | None = None) -> bool:
        graces = [
            self._grace(r, None)
            for r in self._runtimes.get(key, {}).values()
            if sandbox_id in (None, r.sandbox_id)
        ]
        grace = max(graces, default=None)
        await self._enter(Call("delete", key, sandbox_id=sandbox_id, grace=grace))
        self._maybe_fail("delete", key, None)
        runtimes = self._runtimes.get(key, {})
        doomed = [r for r in runtimes.values() if sandbox_id in (None, r.sandbox_id)]
        await self._end(doomed, None)
        if not runtimes:
            self._runtimes.pop(key, None)
        workspaces = {(k, s) for k, s in self._workspaces if k == key and sandbox_id in (None, s)}
        self._workspaces -= workspaces
        return bool(doomed or workspaces)

    async def _end(self, doomed: builtins.list[_Runtime], timeout: float | None) -> None:
        """Stop the running ones of ``doomed`` (oldest first), then remove each."""
        for runtime in sorted(doomed, key=lambda r: r.generation):
            if runtime.state == "running":
                self._set_state(runtime, "exited", await self._terminate(runtime, timeout))
            self._remove(runtime)

    async def _terminate(self, runtime: _Runtime, timeout: float | None) -> int:
        """SIGTERM; a runtime that ignores it (with real_grace) is killed after its grace."""
        if not (self.real_grace and runtime.ignores_sigterm):
            return self.stop_exit_code
        await asyncio.sleep(self._grace(runtime, timeout))
        return SIGKILL_EXIT_CODE

    async def incarnations(self) -> builtins.set[tuple[str, UUID]]:
        """The HoldingsDriver capability: incarnations with a runtime or a workspace."""
        await self._enter(Call("list", None))
        self._maybe_fail("list", None, None)
        return {(r.key, r.sandbox_id) for r in self._all()} | set(self._workspaces)

    async def get(self, key: str) -> builtins.list[RuntimeInfo]:
        await self._enter(Call("get", key))
        self._maybe_fail("get", key, None)
        return [r.info for _, r in sorted(self._runtimes.get(key, {}).items())]

    async def list(self) -> builtins.list[RuntimeInfo]:
        await self._enter(Call("list", None))
        self._maybe_fail("list", None, None)
        return [r.info for r in self._all()]

    async def watch(self) -> AsyncIterator[WatchObservation]:
        if self._closed:
            return
        # Subscribe and list with no await in between: nothing falls between the two.
        queue, pending = self._streams.open()
        listing = self._listing()
        try:
            for observation in [*listing, *pending]:
                yield observation
            while True:
                item = await queue.get()
                if isinstance(item, _Closed):
                    return
                if isinstance(item, _Relist):
                    for observation in self._listing():
                        yield observation
                    continue
                yield item
        finally:
            self._streams.queues.remove(queue)

    async def close(self) -> None:
        self._closed = True
        self._streams.put(_Closed())
        for handle in self._blocks.values():
            handle.release()

    # -- internals ---------------------------------------------------------------------------

    def _grace(self, runtime: _Runtime, timeout: float | None) -> float:
        return grace_period(timeout, runtime.stop_timeout, self.stop_timeout)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _now(self) -> datetime:
        if self.clock is not None:
            return self.clock()
        return FAKE_EPOCH + timedelta(milliseconds=self._seq)

    def _maybe_fail(self, op: FakeOp, key: str | None, generation: int | None) -> None:
        for failure_key in ((op, key), (op, None)):
            queue = self._failures.get(failure_key)
            if not queue:
                continue
            failure = queue[0]
            if failure.remaining is not None:
                failure.remaining -= 1
                if failure.remaining == 0:
                    queue.popleft()
            observed = failure.observed or self._observed(key, generation)
            raise DriverError(failure.reason, retryable=failure.retryable, observed=observed)

    def _observed(self, key: str | None, generation: int | None) -> ObservedState | None:
        if key is None:
            return None
        runtimes = self._runtimes.get(key, {})
        if generation is None:
            generation = max(runtimes, default=None)
        runtime = runtimes.get(generation) if generation is not None else None
        return observed_state(runtime.state) if runtime is not None else "absent"

    def _all(self) -> builtins.list[_Runtime]:
        return [r for key in sorted(self._runtimes) for _, r in sorted(self._runtimes[key].items())]

    def _set_state(self, runtime: _Runtime, state: RuntimeState, exit_code: int | None) -> None:
        runtime.state, runtime.exit_code = state, exit_code
        runtime.changed_seq = seq = self._next_seq()
        runtime.changed_at = self._now()
        if self.auto_observe:
            self._streams.put(
                runtime.snapshot(f"fake:{runtime.runtime_id}:{seq}:{state}", self.actor, "watch")
            )

    def _remove(self, runtime: _Runtime) -> None:
        if runtime.state == "running":
            self._set_state(runtime, "exited", self.stop_exit_code)
        del self._runtimes[runtime.key][runtime.generation]
        seq = self._next_seq()
        if self.auto_observe:
            observation_id = f"fake:{runtime.runtime_id}:{seq}:removed"
            self._streams.put(runtime.removal(observation_id, self.actor, self._now()))

    def _listing(self) -> builtins.list[WatchObservation]:
        # Ids stable across listings while the runtime's state is unchanged.
        return [
            r.snapshot(f"fake-list:{r.runtime_id}:{r.changed_seq}:{r.state}", self.actor, "list")
            for r in self._all()
        ]
