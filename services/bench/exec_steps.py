"""Where an exec's time goes on Podman (printed by ``python -m services.bench warm`` after its
figures): the Podman driver's calls for one exec (drivers/podman.py ``exec_stream``, made here
one by one against the Podman service, without the control plane), each timed, in a container
of the sandbox image of the bench's own, and the ``podman exec`` command beside them.

- ``list``: ``GET /containers/json`` filtered by name (the driver finds the runtime by key);
- ``create``: ``POST /containers/{id}/exec``;
- ``start``: ``POST /exec/{id}/start`` read to the end of its stream (Podman starts conmon and
  the OCI runtime's exec: the command runs and exits);
- ``inspect``: ``GET /exec/{id}/json`` (the exit code).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid

from podman import PodmanClient
from podman.domain.containers import Container

from drivers.podman_exec import frames
from services.bench.drivers import Figures
from services.common.settings import Settings

STEPS = ("list", "create", "start", "inspect")


async def exec_steps(settings: Settings, samples: int) -> list[Figures]:
    return await asyncio.to_thread(_steps, settings, samples)


def _steps(settings: Settings, samples: int) -> list[Figures]:
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
    finally:
        container.stop(timeout=1)
        client.close()  # type: ignore[no-untyped-call]
    return [Figures(f"exec on Podman: {step}", values) for step, values in times.items()]
