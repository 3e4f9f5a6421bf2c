"""What runs inside a container, seen from the host (Podman's top reads the container's
processes itself: no ``ps`` in the image needed), for the exec tests."""

from __future__ import annotations

from podman import PodmanClient


def commands_in(podman: PodmanClient, container: str) -> list[str]:
    """The command line of every live process in the container now (zombies, dead already
    and waiting for their parent to reap them, left out)."""
    top = podman.containers.get(container).top(ps_args="pid,state,args")
    assert isinstance(top, dict)
    return [" ".join(row[2:]) for row in top["Processes"] if row[1] != "Z"]


def running_with(podman: PodmanClient, container: str, marker: str) -> list[str]:
    """The container's processes whose command line holds ``marker``."""
    return [command for command in commands_in(podman, container) if marker in command]
