"""A generation's provider values as Podman secrets ``sandstream-<key>-g<generation>--<NAME>``,
mounted as files and exported by a ``/bin/sh`` wrapper; removed with the generation's container.

Podman before 5.3 shows the values of ``type=env`` secrets in ``podman inspect``
(containers/podman#23788); mounted ones it does not.
"""

from __future__ import annotations

import contextlib
from typing import Any, Final

from podman import PodmanClient
from podman.errors import NotFound

from drivers.podman_objects import container_name
from drivers.protocol import LaunchSpec

SECRETS_DIR: Final = "/run/secrets/sandstream"
# Exports every mounted secret file as a variable named after it, then runs the command.
# (``$(cat ...)`` drops trailing newlines of a value.)
_EXPORT_SECRETS: Final = (
    f'for f in {SECRETS_DIR}/*; do [ -f "$f" ] || continue; '
    'export "${f##*/}=$(cat "$f")"; done; exec "$@"'
)


def secret_prefix(key: str, generation: int) -> str:
    return container_name(key, generation) + "--"


def add_secrets(client: PodmanClient, spec: LaunchSpec, args: dict[str, Any]) -> None:
    """Create this generation's secrets and put the wrapper that exports them in the create
    ``args``; the command becomes the image's entrypoint and command, or the spec's."""
    # The image first: a launch that fails on it must leave no secret behind (the delete
    # finds a generation's secrets only through its container).
    config = client.images.get(spec.spec.image).attrs.get("Config") or {}
    prefix = secret_prefix(spec.key, spec.generation)
    remove_secrets(client, spec.key, spec.generation)  # left by an interrupted launch
    mounts = []
    try:
        for env_name, value in sorted(spec.secrets.items()):
            client.secrets.create(prefix + env_name, value.encode())
            mounts.append(
                {"source": prefix + env_name, "target": f"{SECRETS_DIR}/{env_name}", "mode": 0o400}
            )
    except BaseException:
        remove_secrets(client, spec.key, spec.generation)
        raise
    argv = list(config.get("Entrypoint") or []) + list(spec.spec.command or config.get("Cmd") or [])
    args["secrets"] = mounts
    # Podman 4.3 mounts secrets before the tmpfs mounts, and cannot create their target in
    # a read-only root: a sandbox with credentials gets a writable root (docs/drivers.md).
    args["read_only"] = False
    args["entrypoint"] = ["/bin/sh", "-c", _EXPORT_SECRETS, "sandstream-env"]
    args["command"] = argv


def remove_secrets(client: PodmanClient, key: str, generation: int) -> None:
    """Remove the generation's secrets (none left is fine)."""
    prefix = secret_prefix(key, generation)
    for secret in client.secrets.list():
        if str(secret.name).startswith(prefix):
            with contextlib.suppress(NotFound):
                client.secrets.remove(secret.id)
