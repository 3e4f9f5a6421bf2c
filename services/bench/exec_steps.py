"""Where an exec's time goes on Podman (printed by ``python -m services.bench warm`` after its
figures): the Podman driver's calls for one exec (drivers/podman.py ``exec_stream``, made here
one by one against the Podman service, without the control plane), each timed, in a container
of the sandbox image of the bench's own, and the ``podman exec`` command beside them.

- ``list``: ``GET /containers/json`` filtered by name (the driver finds the runtime by key);
- ``create``: ``POST /containers/{id}/exec``;
- ``start``: ``POST /exec/{id}/start`` read to the end of its stream (Podman starts conmon and
  the OCI runtime's exec: the command runs and exits);
- ``inspect``: ``GET /exec/{id}/json`` (the exit code);

then the exec through runc directly (drivers/podman_runc.py, the driver's runtime path: the
process file written, ``runc exec`` run, its output read to the end, the exit code), where
this process can (``probe``), and ``runc exec`` of the container's own process (no
``--process``) as the floor.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from contextlib import aclosing

from podman import PodmanClient
from podman.domain.containers import Container

from drivers import podman_runc
from drivers.podman_exec import frames
from drivers.podman_runc import Runc
from services.bench.drivers import Figures
from services.common.settings import Settings

STEPS = ("list", "create", "start", "inspect")


async def exec_steps(settings: Settings, samples: int) -> list[Figures]:
    figures, container = await asyncio.to_thread(_steps, settings, samples)
    try:
        runc, why = await asyncio.to_thread(
            podman_runc.probe, settings.podman_url, "runtime", settings.podman_runc_root, 60
        )
        if runc is None:
            print(f"  (no runtime path here: {why})")
            return figures
        return figures + await _runtime(runc, container, samples)
    finally:
        await asyncio.to_thread(_stop, settings, str(container.id))


def _stop(settings: Settings, runtime_id: str) -> None:
    with PodmanClient(base_url=settings.podman_url, timeout=60) as client:
        client.containers.get(runtime_id).stop(timeout=1)


async def runtime_beside_bare(runc: Runc, runtime_id: str) -> tuple[float, float]:
    """Seconds of one ``true`` through the runtime path, then of a bare ``runc exec`` of it."""
    began = time.perf_counter()
    async with aclosing(podman_runc.exec_stream(runc, runtime_id, ["true"])) as events:
        async for _ in events:
            pass
    marked = time.perf_counter()
    argv = [runc.path, "--root", str(runc.root), "exec", runtime_id, "true"]
    await asyncio.to_thread(subprocess.run, argv, check=True, capture_output=True)
    return marked - began, time.perf_counter() - marked


async def _runtime(runc: Runc, container: Container, samples: int) -> list[Figures]:
    """The runtime path's exec, and a bare ``runc exec`` of the container's own process."""
    driver, bare = [], []
    runtime_id = str(container.id)
    for i in range(samples + 2):  # the first two warm up, not counted
        through, alone = await runtime_beside_bare(runc, runtime_id)
        if i >= 2:
            driver.append(through)
            bare.append(alone)
    return [
        Figures("exec through runc: the driver's runtime path", driver),
        Figures("exec through runc: bare `runc exec`", bare),
    ]


def _steps(settings: Settings, samples: int) -> tuple[list[Figures], Container]:
    client = PodmanClient(base_url=settings.podman_url, timeout=60)
    name = f"bench-exec-{uuid.uuid4().hex[:8]}"
    container = client.containers.run(
        settings.sandbox_image, ["sleep", "600"], detach=True, name=name, remove=True
    )
    assert isinstance(container, Container)  # detached: the container, not its output
    times: dict[str, list[float]] = {s: [] for s in (*STEPS, "all four", "podman exec")}
    try:
        for i in range(samples + 2):  # the first two warm up, not counted
            marks = [time.perf_counter()]
            filters = json.dumps({"name": [name]})
            client.api.get("/containers/json", params={"all": True, "filters": filters})
            marks.append(time.perf_counter())
            body = {"AttachStdout": True, "AttachStderr": True, "Tty": False, "Cmd": ["true"]}
            created = client.api.post(f"/containers/{container.id}/exec", data=json.dumps(body))
            exec_id = created.json()["Id"]
            marks.append(time.perf_counter())
            start = json.dumps({"Detach": False, "Tty": False})
            response = client.api.post(f"/exec/{exec_id}/start", data=start, stream=True)
            for _ in frames(response.raw):
                pass
            response.close()
            marks.append(time.perf_counter())
            client.api.get(f"/exec/{exec_id}/json")
            marks.append(time.perf_counter())
            cli = ["podman", "--url", settings.podman_url, "exec", name, "true"]
            subprocess.run(cli, check=True, capture_output=True)
            marks.append(time.perf_counter())
            if i < 2:
                continue
            for step, began, ended in zip(STEPS, marks, marks[1:], strict=False):
                times[step].append(ended - began)
            times["all four"].append(marks[4] - marks[0])
            times["podman exec"].append(marks[5] - marks[4])
    except BaseException:
        container.stop(timeout=1)
        raise
    finally:
        client.close()  # type: ignore[no-untyped-call]
    figures = [Figures(f"exec on Podman: {step}", values) for step, values in times.items()]
    return figures, container
