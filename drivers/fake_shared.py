"""The fake driver with its runtimes in a file, shared by every process that opens the file.

Several executor processes (the checker's, services/chaos) then see one backend, as Podman or
Kubernetes would show them: a runtime launched by one executor can be stopped by another after
a rebalance, and a listing shows everything. Each call takes an exclusive lock on the file,
loads the state, runs the in-memory fake's operation and stores the state again; the fake's
operations do not suspend (no blocks, no real grace periods here), so a call is atomic.

Watch streams stay per process: a process's stream starts with a listing of the shared state
and then carries the changes this process made (the reconciler's listing covers the rest).
"""

from __future__ import annotations

import builtins
import fcntl
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

from drivers.fake import FakeDriver
from drivers.protocol import LaunchResult, LaunchSpec, OpResult, RuntimeInfo, WatchObservation


class SharedFakeDriver(FakeDriver):
    def __init__(self, state_file: Path, **options: Any) -> None:
        """``options``: FakeDriver's (actor, clock, stop_timeout, ...)."""
        super().__init__(**options)
        self.state_file = state_file
        self._lock_file = state_file.with_name(state_file.name + ".lock")

    @contextmanager
    def _shared(self, write: bool = True) -> Iterator[None]:
        """Hold the lock with the shared state loaded; store it afterwards when ``write``."""
        self._lock_file.parent.mkdir(parents=True, exist_ok=True)
        with self._lock_file.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if self.state_file.exists():
                    state = pickle.loads(self.state_file.read_bytes())
                    self._runtimes, self._workspaces, self._seq = state
                try:
                    yield
                finally:  # a failed call may have changed the state too (a launch's cleanup)
                    if write:
                        self._store()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _store(self) -> None:
        data = pickle.dumps((self._runtimes, self._workspaces, self._seq))
        partial = self.state_file.with_name(self.state_file.name + ".partial")
        partial.write_bytes(data)
        partial.replace(self.state_file)

    async def launch(self, spec: LaunchSpec) -> LaunchResult:
        with self._shared():
            return await super().launch(spec)

    async def stop(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        with self._shared():
            return await super().stop(key, generation, timeout)

    async def suspend(self, key: str, generation: int, timeout: float | None = None) -> OpResult:
        with self._shared():
            return await super().suspend(key, generation, timeout)

    async def kill(self, key: str, generation: int) -> OpResult:
        with self._shared():
            return await super().kill(key, generation)

    async def delete(self, key: str, sandbox_id: UUID | None = None) -> bool:
        with self._shared():
            return await super().delete(key, sandbox_id)

    async def get(self, key: str) -> builtins.list[RuntimeInfo]:
        with self._shared(write=False):
            return await super().get(key)

    async def list(self) -> builtins.list[RuntimeInfo]:
        with self._shared(write=False):
            return await super().list()

    def _listing(self) -> builtins.list[WatchObservation]:
        with self._shared(write=False):
            return super()._listing()
