"""The Podman calls of a suspend that keeps memory: the checkpoint a suspend takes and the
restore a resume's launch tries (the store and the archive's rewrite: drivers/podman_checkpoint.py).
"""

from __future__ import annotations

import contextlib
import tarfile
from collections.abc import Callable
from typing import Any

from podman import PodmanClient
from podman.errors import APIError, NotFound

from drivers.podman_checkpoint import (
    CRIU_PARAMS,
    LABEL_SPEC_HASH,
    RESTORE_OPTIONS,
    Checkpoints,
    Rewrite,
    copy_rewritten,
    spec_hash,
)
from drivers.podman_objects import BACKEND_ERRORS, Container, container_name
from drivers.protocol import DriverError, LaunchSpec

# The notes a suspend and a resume's launch leave in their result (the history shows them).
RESTORED = "memory restored from the suspend's checkpoint"
FRESH = "started afresh on the kept workspace"
NOT_KEPT = "memory not kept (storage only)"
# Why neither a suspend keeps nor a resume restores the memory of an agent given provider
# values: it holds the ones it read, which a rotation or a detach must take away.
WITH_PROVIDERS = "providers are attached: their values are mounted afresh at each start"
RESTART_AFRESH = "a restart starts the agent afresh"
# Seconds a checkpoint or a restore may take (CRIU writes or reads the agent's whole memory).
RESTORE_TIMEOUT = CHECKPOINT_TIMEOUT = 300.0
# What a failed restore may raise: each falls back to a fresh start.
RESTORE_ERRORS = (*BACKEND_ERRORS, DriverError, tarfile.TarError, ValueError, KeyError)


def restore_or_create(
    client: PodmanClient,
    store: Checkpoints | None,
    spec: LaunchSpec,
    args: dict[str, Any],
    create: Callable[[LaunchSpec], str],
) -> tuple[str, str | None, bool]:
    """The incarnation's checkpoint restored as this generation's container (running), or a
    container made by ``create`` (not started yet); a note saying which when there was a
    checkpoint; whether it was restored. The checkpoint is used once: removed once either
    container exists (a create that fails, the backend away, leaves it to the launch's retry)."""
    facts = store.load(spec.key, spec.sandbox_id) if store else None
    if store is None or facts is None:
        return create(spec), None, False
    why_not = restore_refusal(spec, facts, args)
    if why_not is None:
        try:
            restored = restore(client, store, spec, RESTORE_TIMEOUT)
            store.remove(spec.key, spec.sandbox_id)
            return restored, f"{RESTORED} of generation {facts['generation']}", True
        except RESTORE_ERRORS as exc:
            why_not = f"its restore failed: {first_line(exc)}"
    created = create(spec)
    store.remove(spec.key, spec.sandbox_id)
    return created, f"{FRESH}: the memory checkpoint was not restored ({why_not})", False


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:400]


def checkpoint(client: PodmanClient, store: Checkpoints, container: Container) -> str:
    """Checkpoint ``container`` into the store (it ends, exited); a note saying so, or why its
    memory is not kept (the suspend then stops it as usual)."""
    info = container.info
    if info.state != "running":
        return f"{NOT_KEPT}: the container was {info.state}, not running"
    try:
        # An older one is of an older generation. A directory that cannot change (read-only)
        # fails the checkpoint, never the suspend.
        store.remove(info.key, info.sandbox_id)
        config = client.containers.get(info.runtime_id).attrs.get("Config") or {}
        if config.get("Secrets"):  # never restorable: refused, or its secrets gone at resume
            return f"{NOT_KEPT}: {WITH_PROVIDERS}"
        facts = {
            "key": info.key,
            "sandbox_id": str(info.sandbox_id),
            "generation": str(info.generation),
            "spec_hash": str((config.get("Labels") or {}).get(LABEL_SPEC_HASH, "")),
        }
        response = client.api.post(
            f"/containers/{info.runtime_id}/checkpoint",
            params={"export": "true", **CRIU_PARAMS},
            stream=True,
            timeout=CHECKPOINT_TIMEOUT,
        )
        try:
            if response.status_code != 200:
                raise APIError(f"checkpoint answered {response.status_code}: {response.text[:300]}")
            size = store.save(info.key, info.sandbox_id, response.iter_content(1 << 20), facts)
        finally:
            response.close()  # however the save ends: an unread stream would hold the container
    except BACKEND_ERRORS as exc:  # a timeout too (requests' errors are OSErrors)
        with contextlib.suppress(OSError):  # the directory may be what failed
            store.remove(info.key, info.sandbox_id)
        return f"{NOT_KEPT}: its checkpoint failed: {first_line(exc)}"
    return f"memory kept: generation {info.generation} checkpointed ({size // 1024} KiB)"


def restore_refusal(spec: LaunchSpec, facts: dict[str, str], args: dict[str, Any]) -> str | None:
    """Why the checkpoint must not become this launch's container (``args``: its create
    arguments), or None."""
    if spec.afresh:
        return RESTART_AFRESH
    if spec.secrets:
        return WITH_PROVIDERS
    if facts.get("spec_hash") != spec_hash(args):
        return "the sandbox's launch arguments changed since the suspend"
    return None


def restore(client: PodmanClient, store: Checkpoints, spec: LaunchSpec, timeout: float) -> str:
    """The incarnation's checkpoint restored (running) as ``spec``'s generation's container;
    its id. A failed one leaves nothing behind."""
    name = container_name(spec.key, spec.generation)
    config = store.criu_config(name)
    archive = store.archive(spec.key, spec.sandbox_id)
    upload = archive.with_suffix(".restore")
    config.write_text(RESTORE_OPTIONS)
    try:
        copy_rewritten(archive, upload, Rewrite(spec.generation, spec.identity, str(config)))
        with upload.open("rb") as body:
            response = client.api.post(
                # With import, the name in the path is unused: the archive is the body.
                f"/containers/{name}/restore",
                params={"import": "true", "name": name, **CRIU_PARAMS},
                data=body,
                headers={"Content-Type": "application/x-tar"},
                timeout=timeout,
            )
        if response.status_code != 200:
            # A failed restore leaves the imported container behind, exited: not ours to keep.
            with contextlib.suppress(NotFound, APIError):
                client.containers.remove(name, force=True)
            raise APIError(f"restore answered {response.status_code}: {response.text[:300]}")
        return str(response.json()["Id"])
    finally:
        config.write_text("")  # CRIU refuses mntns-compat-mode on a later checkpoint's dump
        upload.unlink(missing_ok=True)
