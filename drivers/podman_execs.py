"""How the Podman driver's execs reach a container: the path (runc directly or Podman's exec
API, chosen once by ``exec_mode`` and what ``podman_runc.probe`` finds) and the container of
(key, generation), remembered instead of listed on every exec.

Container IDs are never reused and a container's labels never change, so an ID found for
(key, generation) stays that generation's until the container is gone. The driver remembers the
container it launched (``remember``) and the running ones its watch sees (``seen_running``), so the
first exec in a pool member a claim adopted in the same process looks nothing up; others are
looked up once, on the first exec. An exec that finds the remembered one gone, stopped or
paused has started nothing (``NotStarted``): the entry is forgotten and the key listed once,
which answers as without the memory (another container, or "no running runtime").
docs/adr/0010-podman-exec-through-runc.md says why.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Final, TypeVar

from drivers import podman_exec, podman_runc
from drivers.podman_exec import NotStarted
from drivers.podman_objects import BACKEND_ERRORS, describe
from drivers.podman_runc import ExecMode, Runc
from drivers.protocol import DriverError, ExecEvent
from events.observations import RuntimeRemoved, RuntimeSnapshot

log = logging.getLogger("sandstream.drivers.podman")

REMEMBERED: Final = 4096  # (key, generation) -> container ID entries kept (least recent out)
Observed = TypeVar("Observed")  # an observation of the watch, handed on as it came


class PodmanExecs:
    """The exec path and the remembered containers of one driver. ``running`` lists the
    running container of (key, generation) (a DriverError when there is none)."""

    def __init__(
        self,
        base_url: str,
        *,
        mode: ExecMode,
        runc_root: Path,
        request_timeout: float,
        grace: float,
        running: Callable[[str, int], Awaitable[str]],
    ) -> None:
        self.base_url = base_url
        self.mode: ExecMode = mode
        self.grace = grace
        self._runc_root = runc_root
        self._request_timeout = request_timeout
        self._running = running
        self._runc: Runc | None = None
        self._why = ""  # why not runc, once probed
        self._probed = False
        self._probing = asyncio.Lock()
        self.ids: OrderedDict[tuple[str, int], str] = OrderedDict()

    async def stream(
        self,
        key: str,
        generation: int,
        command: builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        stdin: bytes | None = None,
    ) -> AsyncGenerator[ExecEvent, None]:
        """The command's events, in the remembered container or else the listed one."""
        runc = await self.runtime()
        if (key, generation) in self.ids:
            self.ids.move_to_end((key, generation))
        for remembered in (self.ids.get((key, generation)), None):
            runtime_id = remembered or await self._listed(key, generation)
            events = self._events(runc, runtime_id, command, env, workdir, stdin)
            async with contextlib.aclosing(events):  # closed with this one: the command ends
                try:
                    first = await anext(events)
                except NotStarted:
                    self.forget(key, generation, runtime_id)
                    if remembered is None:
                        raise
                    continue
                yield first
                async for event in events:
                    yield event
                return

    @property
    def path(self) -> str:
        """Which path the execs take (once probed), and why not runc if not."""
        if not self._probed:
            return f"{self.mode} (not probed yet)"
        if self._runc is not None:
            return f"runtime ({self._runc.path} --root {self._runc.root})"
        return f"api ({self._why})"

    async def runtime(self) -> Runc | None:
        """runc where the mode and the host allow it (asked once), else None (Podman's exec
        API). Mode "runtime" where runc cannot serve: a DriverError at each exec."""
        async with self._probing:
            if not self._probed:
                try:
                    self._runc, self._why = await asyncio.to_thread(
                        podman_runc.probe, self.base_url, self.mode, self._runc_root,
                        self._request_timeout,
                    )  # fmt: skip
                except BACKEND_ERRORS as exc:
                    raise DriverError(f"exec failed: {describe(exc)}", retryable=True) from exc
                self._probed = True
                log.info("exec path: %s", self.path)
        if self._runc is None and self.mode == "runtime":
            raise DriverError(f"exec through runc is not possible here: {self._why}",
                              retryable=True)  # fmt: skip
        return self._runc

    def _events(
        self,
        runc: Runc | None,
        runtime_id: str,
        command: builtins.list[str],
        env: Mapping[str, str] | None,
        workdir: str | None,
        stdin: bytes | None,
    ) -> AsyncGenerator[ExecEvent, None]:
        # "auto": a container runc has no state of here (another state root or namespace than
        # Podman's, or gone) goes through Podman, which knows which.
        if runc is not None and (self.mode == "runtime" or runc.bundle(runtime_id)):
            return podman_runc.exec_stream(
                runc, runtime_id, command, env=env, workdir=workdir, stdin=stdin,
                grace=self.grace,
            )  # fmt: skip
        return podman_exec.exec_stream(
            self.base_url, runtime_id, command, env=env, workdir=workdir, stdin=stdin,
            request_timeout=self._request_timeout, grace=self.grace,
        )  # fmt: skip

    def remember(self, key: str, generation: int, runtime_id: str) -> None:
        """``runtime_id`` is (key, generation)'s running container: the driver launched it
        (the newest word: it replaces what was remembered) or found it running."""
        self.ids[(key, generation)] = runtime_id
        self.ids.move_to_end((key, generation))
        while len(self.ids) > REMEMBERED:
            self.ids.popitem(last=False)

    def seen_running(self, key: str, generation: int, runtime_id: str) -> None:
        """The driver's watch saw ``runtime_id`` of (key, generation) running: remembered,
        unless another one is (a launch's newer word beats a late event of the container it
        replaced; an exec corrects a wrong one)."""
        if (key, generation) not in self.ids:
            self.remember(key, generation, runtime_id)

    def note(self, observation: Observed) -> Observed:
        """``observation`` of the driver's watch, its running or removed container told to the
        memory (``seen_running``, ``forget``)."""
        if isinstance(observation, RuntimeRemoved) and observation.runtime_id:
            self.forget(observation.key, observation.generation, observation.runtime_id)
        elif (
            isinstance(observation, RuntimeSnapshot)
            and observation.state == "running"
            and observation.runtime_id
        ):
            self.seen_running(observation.key, observation.generation, observation.runtime_id)
        return observation

    def forget(self, key: str, generation: int, runtime_id: str) -> None:
        """Forget ``runtime_id`` as (key, generation)'s, if it is the one remembered."""
        if self.ids.get((key, generation)) == runtime_id:
            del self.ids[(key, generation)]

    async def _listed(self, key: str, generation: int) -> str:
        runtime_id = await self._running(key, generation)
        self.remember(key, generation, runtime_id)
        return runtime_id
