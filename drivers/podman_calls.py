"""The Podman driver's blocking halves: each operation as synchronous calls of the ``podman``
package, one client per worker thread. They run only in the driver's worker threads.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import math
import threading
from typing import Any
from uuid import UUID

from podman import PodmanClient
from podman.errors import APIError, NotFound

from drivers.labels import incarnation_of
from drivers.launch_precheck import launch_precheck
from drivers.podman_checkpoint import Checkpoints
from drivers.podman_memory import checkpoint, restore_or_create
from drivers.podman_objects import (
    ALIVE,
    Container,
    container_name,
    ensure_volume,
    list_volumes,
    read_container,
    remove_volume,
    volume_name,
)
from drivers.podman_secrets import add_secrets, remove_secrets
from drivers.podman_spec import create_args
from drivers.protocol import (
    LABEL_KEY,
    LABEL_MANAGED_BY,
    LABEL_SANDBOX_ID,
    MANAGED_BY,
    DriverError,
    Incarnation,
    LaunchResult,
    LaunchSpec,
    OpResult,
    grace_period,
    observed_state,
)
from events.common import SandboxResources
from events.observations import ObservedState

log = logging.getLogger("sandstream.drivers.podman")


class PodmanCalls:
    """Launch, stop, kill, delete and the reads, as blocking Podman calls."""

    def __init__(
        self,
        base_url: str,
        *,
        stop_timeout: float,
        request_timeout: float,
        init: bool,
        limits: SandboxResources,
        checkpoints: Checkpoints | None = None,
    ) -> None:
        self.base_url = base_url
        # Set: a suspend keeps the agent's memory (drivers/podman_checkpoint.py).
        self.checkpoints = checkpoints
        self.stop_timeout = stop_timeout
        self.request_timeout = request_timeout
        self.init = init
        self.limits = limits
        self._local = threading.local()
        self._clients: builtins.list[PodmanClient] = []
        self._clients_lock = threading.Lock()

    def client(self) -> PodmanClient:
        """One client per worker thread (a requests session is not meant to be shared)."""
        client: PodmanClient | None = getattr(self._local, "client", None)
        if client is None:
            client = PodmanClient(base_url=self.base_url, timeout=self.request_timeout)
            self._local.client = client
            with self._clients_lock:
                self._clients.append(client)
        return client

    def close(self) -> None:
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()  # type: ignore[no-untyped-call]

    # -- reads -------------------------------------------------------------------------------

    def list(
        self, key: str | None, sandbox_id: UUID | None = None, generation: int | None = None
    ) -> builtins.list[Container]:
        """Our containers (of ``key``, of one incarnation, of one generation), sorted."""
        # One label filter on the server (the most selective); the rest is checked here.
        label = f"{LABEL_KEY}={key}" if key is not None else f"{LABEL_MANAGED_BY}={MANAGED_BY}"
        listed = self.client().containers.list(all=True, filters=[f"label={label}"])
        found = [read_container(c.attrs) for c in listed]
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

    def volumes(self, key: str, sandbox_id: UUID | None) -> builtins.list[str]:
        """Our workspace volumes of ``key`` (of one incarnation).

        Podman 4.3 ORs several label filters on volumes (it ANDs them on containers), so
        the server filters on the key label alone and the rest is checked here.
        """
        listed = list_volumes(self.client(), f"{LABEL_KEY}={key}")
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

    def incarnations(self) -> set[Incarnation]:
        """The incarnations of our containers, volumes and checkpoints. (Provider secrets carry
        no labels in Podman 4.3: the delete removes them with their containers.)"""
        found = {(c.info.key, c.info.sandbox_id) for c in self.list(None)}
        if self.checkpoints is not None:
            found.update(self.checkpoints.held())
        volumes = list_volumes(self.client(), f"{LABEL_MANAGED_BY}={MANAGED_BY}")
        for volume in volumes:
            if (incarnation := incarnation_of(volume.attrs.get("Labels"))) is not None:
                found.add(incarnation)
        return found

    def exit_code(self, runtime_id: str) -> int | None:
        """The container's exit code; None once it is gone. Removed while asked (a kill that
        ended a stop, whose delete then removed it), Podman 4.3 answers 500 "no such container"
        rather than 404: gone too."""
        try:
            attrs = self.client().containers.get(runtime_id).attrs
        except NotFound:
            return None
        except APIError as exc:
            if "no such container" not in str(exc):
                raise
            return None
        container = read_container(attrs)
        return container.info.exit_code if container else None

    def observe(self, key: str, generation: int | None) -> tuple[ObservedState | None, int | None]:
        """What the backend looks like now, for a DriverError: the generation's runtime (or
        the newest one), "absent" when nothing of the key is left, None when only its
        workspace is (not absent, not a runtime state either)."""
        found = self.list(key, generation=generation)
        if found:
            info = found[-1].info
            return observed_state(info.state), info.exit_code
        if generation is None and self.volumes(key, None):
            return None, None
        return "absent", None

    def exec(self, key: str, generation: int, command: builtins.list[str]) -> tuple[int, str]:
        found = self.list(key, generation=generation)
        if not found:
            raise DriverError(f"no runtime of {key} generation {generation}", retryable=False)
        container = self.client().containers.get(found[-1].info.runtime_id)
        code, output = container.exec_run(command, demux=True)
        out, err = output if isinstance(output, tuple) else (output, None)
        return int(code if code is not None else -1), (out or b"").decode() + (err or b"").decode()

    # -- lifecycle ---------------------------------------------------------------------------

    def launch(self, spec: LaunchSpec) -> LaunchResult:
        plan = launch_precheck(spec, self.list(spec.key))
        for container in plan.replace:
            if container.info.generation == spec.generation:
                log.warning("replacing %s: it has another identity or incarnation",
                            container.info.runtime_id)  # fmt: skip
            self._remove(container, self.grace(container))
        if plan.refusal is not None:
            raise plan.refusal
        adopted, note, restored = plan.current is not None, None, False
        if plan.current is not None:
            runtime_id = plan.current.info.runtime_id
        else:
            runtime_id, note, restored = restore_or_create(
                self.client(), self.checkpoints, spec, self._args(spec), self._create
            )
        if plan.starts and not restored:  # a restored container runs already
            self.client().containers.get(runtime_id).start()
        started = plan.starts
        return LaunchResult(runtime_id, spec.generation, spec.identity, started, adopted, note=note)

    def _args(self, spec: LaunchSpec) -> dict[str, Any]:
        volume = volume_name(spec.key, spec.sandbox_id)
        return create_args(
            spec, volume=volume, init=self.init, stop_timeout=self.stop_timeout, limits=self.limits
        )

    def _create(self, spec: LaunchSpec) -> str:
        client = self.client()
        ensure_volume(client, spec.key, spec.sandbox_id)
        args = self._args(spec)
        if not spec.secrets:
            return self._create_container(spec, args)
        add_secrets(client, spec, args)
        try:
            return self._create_container(spec, args)
        except BaseException:
            # No container of ours refers to them: the delete would never find them, and they
            # hold the provider values.
            remove_secrets(client, spec.key, spec.generation)
            raise

    def _create_container(self, spec: LaunchSpec, args: dict[str, Any]) -> str:
        client = self.client()
        try:
            return str(client.containers.create(spec.spec.image, **args).id)
        except APIError as exc:
            if "already in use" not in str(exc):
                raise
        # The name is taken: by a concurrent launch of the same generation, or by a stranger.
        name = container_name(spec.key, spec.generation)
        container = read_container(client.containers.get(name).attrs)
        if container is None or container.info.generation != spec.generation:
            raise DriverError(
                f"container name {name} is in use by a container sandstream does not manage",
                retryable=False,
            )
        return container.info.runtime_id

    def grace(self, container: Container, timeout: float | None = None) -> float:
        """The grace period for stopping ``container`` (its own is its stop-timeout label)."""
        return grace_period(timeout, container.stop_timeout, self.stop_timeout)

    def stop(self, key: str, generation: int, timeout: float | None) -> OpResult:
        found = self.list(key, generation=generation)
        if not found:
            return OpResult("already_absent")
        info = found[-1].info
        grace = self.grace(found[-1], timeout)
        # A stop of one still stopping is sent too: a shorter grace period shortens its stop.
        if info.state in ALIVE and not self._stop_container(info.runtime_id, grace):
            return OpResult("already_absent")
        exit_code = self.exit_code(info.runtime_id) if info.state != "created" else None
        return OpResult("succeeded", info.runtime_id, exit_code)

    def suspend(self, key: str, generation: int, timeout: float | None) -> OpResult:
        """Stop and remove the runtimes of ``generation`` and older; the volume stays. With a
        checkpoint store, a running one of ``generation`` is checkpointed first (its memory)."""
        found = [c for c in self.list(key) if c.info.generation <= generation]
        if not found:
            return OpResult("already_absent")
        note, current = None, found[-1]
        if self.checkpoints is not None and current.info.generation == generation:
            note = checkpoint(self.client(), self.checkpoints, current)
        for container in found:
            self._remove(container, self.grace(container, timeout))
        return OpResult("succeeded", current.info.runtime_id, note=note)

    def kill(self, key: str, generation: int) -> OpResult:
        found = self.list(key, generation=generation)
        if not found:
            return OpResult("already_absent")
        info = found[-1].info
        if info.state in ALIVE:  # a stopping one too: forcing a stop under way is the point
            response = self.client().api.post(
                f"/containers/{info.runtime_id}/kill",
                params={"signal": "SIGKILL"},
                timeout=self.request_timeout,
            )
            if response.status_code == 404:
                return OpResult("already_absent")
            # Refused when it stopped in between ("container state improper"): that is fine.
            if response.status_code != 204 and self._alive(info.runtime_id):
                response.raise_for_status()
                raise APIError(f"unexpected status {response.status_code} from kill")
        return OpResult("succeeded", info.runtime_id, self.exit_code(info.runtime_id))

    def delete(self, key: str, sandbox_id: UUID | None) -> bool:
        containers = self.list(key, sandbox_id)
        for container in containers:
            self._remove(container, self.grace(container))
        volumes = self.volumes(key, sandbox_id)
        client = self.client()
        for volume in volumes:
            remove_volume(client, volume)
        checkpoints = self.checkpoints.remove(key, sandbox_id) if self.checkpoints else False
        return bool(containers or volumes or checkpoints)

    def _alive(self, runtime_id: str) -> bool:
        try:
            attrs = self.client().containers.get(runtime_id).attrs
        except NotFound:
            return False
        container = read_container(attrs)
        return container is not None and container.info.state in ALIVE

    def _paused(self, runtime_id: str) -> bool:
        try:
            attrs = self.client().containers.get(runtime_id).attrs
        except NotFound:
            return False
        return bool((attrs.get("State") or {}).get("Status") == "paused")

    def _stop_container(self, runtime_id: str, grace: float) -> bool:
        """SIGTERM, then SIGKILL after ``grace`` seconds; False if the container is gone."""
        seconds = max(0, math.ceil(grace))

        def send() -> Any:
            return self.client().api.post(
                f"/containers/{runtime_id}/stop",
                params={"timeout": seconds},
                timeout=seconds * 1.5 + self.request_timeout,
            )

        response = send()
        if response.status_code >= 500 and self._paused(runtime_id):
            # Podman refuses to stop a paused container ("container state improper"): thawed,
            # it gets its SIGTERM and grace period as a running one does.
            self.client().api.post(
                f"/containers/{runtime_id}/unpause", timeout=self.request_timeout
            )
            response = send()
        if response.status_code == 404:
            return False
        if response.status_code not in (204, 304):  # 304: it was not running any more
            response.raise_for_status()
            raise APIError(f"unexpected status {response.status_code} from stop")
        return True

    def _remove(self, container: Container, grace: float) -> None:
        """Stop and remove a container, its provider secrets and its CRIU config file if any."""
        self._stop_and_remove(container.info.runtime_id, grace)
        remove_secrets(self.client(), container.info.key, container.info.generation)
        if self.checkpoints is not None and container.name:
            self.checkpoints.remove_config(container.name)

    def _stop_and_remove(self, runtime_id: str, grace: float) -> None:
        if self._stop_container(runtime_id, grace):
            with contextlib.suppress(NotFound):
                self.client().containers.remove(runtime_id, force=True)


def running_id(calls: PodmanCalls, key: str, generation: int) -> str | None:
    """The running container of (key, generation): by its name (one inspect), else from the
    key's listing (every container of the key: slower); None when none runs."""
    answer = calls.client().api.get(f"/containers/{container_name(key, generation)}/json")
    found = read_container(answer.json()) if answer.status_code == 200 else None
    if found is None or (found.info.key, found.info.generation) != (key, generation):
        listed = calls.list(key, None, generation)
        found = listed[-1] if listed else None
    return found.info.runtime_id if found and found.info.state == "running" else None
