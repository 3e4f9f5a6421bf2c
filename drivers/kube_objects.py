"""Pure half of the Kubernetes driver: the objects it creates and how it reads them back.

Pods and claims are plain JSON dicts (as the API server sends and takes them), so everything
here is a function from dicts and specs to dicts, states and observations; nothing does I/O.
The mapping is documented in docs/drivers.md ("Kubernetes mapping").
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final
from uuid import UUID

from drivers.labels import generation_labels, parse_labels, runtime_labels, workspace_labels
from drivers.protocol import (
    IDENTITY_ENV,
    LABEL_GENERATION,
    LABEL_KEY,
    LABEL_MANAGED_BY,
    LABEL_SANDBOX_ID,
    MANAGED_BY,
    WORKSPACE_PATH,
    LaunchSpec,
    RuntimeInfo,
    grace_period,
)
from events.observations import RuntimeRemoved, RuntimeSnapshot, RuntimeState

Pod = Mapping[str, Any]

ACTOR: Final = "kubernetes-watcher"
CONTAINER: Final = "sandbox"  # the one container of a sandbox Pod
WORKSPACE_VOLUME: Final = "workspace"
# Why a suspend is refused without a storage class (the API says so before it accepts one).
WORKSPACE_DIES_WITH_POD: Final = (
    "the Kubernetes driver runs without a storage class (SANDSTREAM_KUBE_STORAGE_CLASS unset): "
    "the workspace is an emptyDir removed with the Pod, so a suspend would lose it"
)
# The sandbox's own labels, all of them, as JSON (Kubernetes label values are limited to 63
# characters of a small alphabet; those that fit are Pod labels as well).
ANNOTATION_LABELS: Final = "io.sandstream.labels"
MANAGED_SELECTOR: Final = f"{LABEL_MANAGED_BY}={MANAGED_BY}"

_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_LABEL_PREFIX_PART = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?$")


@dataclass(frozen=True)
class PodSettings:
    """How the driver shapes every Pod (from the driver's configuration)."""

    stop_timeout: float = 10.0
    service_account: str | None = None
    image_pull_policy: str = "IfNotPresent"
    cpu_limit: str | None = None
    memory_limit: str | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, str], ...] = ()
    storage_class: str | None = None  # None: the workspace is an emptyDir (lives with the Pod)
    workspace_size: str = "1Gi"


def pod_name(key: str, generation: int) -> str:
    return f"sandstream-{key}-g{generation}"


def secret_name(key: str, generation: int) -> str:
    """The Secret holding one generation's provider values (named like its Pod)."""
    return pod_name(key, generation)


def claim_name(key: str, sandbox_id: UUID) -> str:
    return f"sandstream-{key}-{sandbox_id.hex[:12]}"


def key_selector(key: str) -> str:
    return f"{MANAGED_SELECTOR},{LABEL_KEY}={key}"


def is_label(key: str, value: str) -> bool:
    """True when (key, value) is a valid Kubernetes label."""
    prefix, _, name = key.rpartition("/")
    return (
        bool(_LABEL_NAME.fullmatch(name))
        and (not prefix or bool(_LABEL_PREFIX_PART.fullmatch(prefix)))
        and bool(_LABEL_VALUE.fullmatch(value))
    )


def pod_labels(spec: LaunchSpec) -> dict[str, str]:
    """The runtime labels (drivers/labels.py) of the sandbox's own labels that are valid
    Kubernetes labels; all of them go in the annotation ``io.sandstream.labels``."""
    return runtime_labels(spec, valid=is_label)


def claim_manifest(spec: LaunchSpec, settings: PodSettings) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": claim_name(spec.key, spec.sandbox_id),
            "labels": workspace_labels(spec.key, spec.sandbox_id),
        },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": settings.storage_class,
            "resources": {"requests": {"storage": settings.workspace_size}},
        },
    }


def secret_manifest(spec: LaunchSpec) -> dict[str, Any]:
    """The Secret of one generation: the attached providers' values, labelled like its Pod
    (the driver then makes the Pod its owner, so it goes with the Pod)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name(spec.key, spec.generation),
            "labels": generation_labels(spec.key, spec.sandbox_id, spec.generation),
        },
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(spec.secrets.items())},
    }


def owned_by(pod: Pod) -> list[dict[str, Any]]:
    """The JSON patch that makes ``pod`` a Secret's owner (the garbage collector removes the
    Secret once the Pod is gone)."""
    meta = _meta(pod)
    owner = {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}
    return [{"op": "add", "path": "/metadata/ownerReferences", "value": [owner]}]


def secret_generation(secret: Mapping[str, Any]) -> tuple[UUID, int] | None:
    """(sandbox id, generation) of one of our Secrets; None for anything else."""
    labels = _meta(secret).get("labels") or {}
    if labels.get(LABEL_MANAGED_BY) != MANAGED_BY:
        return None
    try:
        return UUID(str(labels.get(LABEL_SANDBOX_ID, ""))), int(labels.get(LABEL_GENERATION, ""))
    except ValueError:
        return None


def container_env(spec: LaunchSpec) -> list[dict[str, Any]]:
    """The spec's env and the identity as values; provider values only as references to the
    generation's Secret (they win over a spec variable of the same name, as with Podman)."""
    plain = {k: v for k, v in spec.spec.env.items() if k not in spec.secrets}
    env: list[dict[str, Any]] = [
        {"name": k, "value": v} for k, v in {**plain, IDENTITY_ENV: spec.identity}.items()
    ]
    name = secret_name(spec.key, spec.generation)
    env += [
        {"name": k, "valueFrom": {"secretKeyRef": {"name": name, "key": k}}}
        for k in sorted(spec.secrets)
    ]
    return env


def pod_manifest(spec: LaunchSpec, settings: PodSettings) -> dict[str, Any]:
    """The Pod of one generation: one container, never restarted, the workspace mounted."""
    grace = grace_period(None, spec.spec.stop_timeout_seconds, settings.stop_timeout)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.spec.image,
        "imagePullPolicy": settings.image_pull_policy,
        "env": container_env(spec),
        "volumeMounts": [{"name": WORKSPACE_VOLUME, "mountPath": WORKSPACE_PATH}],
        "workingDir": WORKSPACE_PATH,
    }
    if spec.spec.command:
        container["command"] = list(spec.spec.command)
    limits = {"cpu": settings.cpu_limit, "memory": settings.memory_limit}
    if any(limits.values()):
        container["resources"] = {"limits": {k: v for k, v in limits.items() if v}}
    if settings.storage_class is None:
        workspace: dict[str, Any] = {"name": WORKSPACE_VOLUME, "emptyDir": {}}
    else:
        workspace = {
            "name": WORKSPACE_VOLUME,
            "persistentVolumeClaim": {"claimName": claim_name(spec.key, spec.sandbox_id)},
        }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "restartPolicy": "Never",  # an exit is the sandbox's outcome (Completed or Error)
        "terminationGracePeriodSeconds": math.ceil(grace),
        "hostname": spec.key,
        # The sandbox gets no credentials for the cluster it runs in, nor the addresses of its
        # namespace's Services as <SERVICE>_PORT=tcp://... variables (an agent's own settings).
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "volumes": [workspace],
    }
    if settings.service_account:
        pod_spec["serviceAccountName"] = settings.service_account
    if settings.node_selector:
        pod_spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in settings.tolerations]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(spec.key, spec.generation),
            "labels": pod_labels(spec),
            "annotations": {ANNOTATION_LABELS: json.dumps(spec.spec.labels, sort_keys=True)},
        },
        "spec": pod_spec,
    }


# --------------------------------------------------------------------------- reading back


@dataclass(frozen=True, slots=True)
class PodView:
    """A sandstream Pod as read back: identity from its labels, state from its status."""

    info: RuntimeInfo
    name: str
    resource_version: str
    terminating: bool  # a deletion timestamp is set: the stop is in progress
    stop_timeout: int | None  # the sandbox's own grace period (its label), if any
    claim: str | None = None  # the workspace claim it mounts, if any
    secret: str | None = None  # the Secret its env refers to (provider values), if any
    pull_failure: str | None = None  # why its image cannot be pulled (pull_failure), if so

    @property
    def uid(self) -> str:
        return self.info.runtime_id

    @property
    def since(self) -> datetime | None:
        """When it entered its current state, if the status says."""
        return self.info.since


def _meta(pod: Pod) -> Mapping[str, Any]:
    meta = pod.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


# A sandbox container waiting for one of these cannot start until the image or the registry
# changes: the kubelet has failed a pull and backs off (it retries for ever), or the name is
# invalid, or the policy forbids a pull. A launch fails on it at once, not at its timeout.
PULL_FAILED: Final = frozenset({"ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})


def pull_failure(pod: Pod) -> str | None:
    """The kubelet's reason and message when the sandbox container's image cannot be pulled."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if cs.get("name") == CONTAINER and waiting.get("reason") in PULL_FAILED:
            return f"{waiting['reason']}: {waiting.get('message') or 'no message'}"
    return None


def pod_state(pod: Pod) -> tuple[RuntimeState, int | None, datetime | None]:
    """(state, exit code, since) of the sandbox container.

    The container's own state wins (a terminated container with its exit code); otherwise the
    Pod phase: Pending is created, Running running, Succeeded exited 0, Failed exited with an
    unknown code, Unknown (the node stopped reporting) running.
    """
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") != CONTAINER:
            continue
        state = cs.get("state") or {}
        if "terminated" in state:
            done = state["terminated"] or {}
            code = done.get("exitCode")
            return (
                "exited",
                int(code) if code is not None else None,
                parse_time(done.get("finishedAt")),
            )
        if "running" in state and status.get("phase") == "Running":
            return "running", None, parse_time((state["running"] or {}).get("startedAt"))
    phase = status.get("phase")
    if phase == "Pending" or phase is None:
        return "created", None, parse_time(_meta(pod).get("creationTimestamp"))
    if phase == "Running":
        return "running", None, parse_time(status.get("startTime"))
    if phase == "Succeeded":
        return "exited", 0, None
    if phase == "Failed":
        return "exited", None, None
    # Unknown: the node stopped reporting. The container may still run, and the Pod must stay
    # visible, so that stop and delete remove it.
    return "running", None, None


def _bounded(since: datetime | None, now: datetime) -> datetime:
    return min(since, now) if since is not None else now


def read_pod(pod: Pod) -> PodView | None:
    """The view of one of our Pods; None for a Pod without (valid) sandstream labels."""
    meta = _meta(pod)
    labels = parse_labels(meta.get("labels"))
    if labels is None or labels.sandbox_id is None:
        return None
    runtime_state, exit_code, since = pod_state(pod)
    deleting = parse_time(meta.get("deletionTimestamp"))
    if deleting is not None and runtime_state != "exited":
        # The stop in progress began then: the deletion timestamp is the request's time plus
        # the grace period (when the kubelet will kill), not when the stop began.
        grace = meta.get("deletionGracePeriodSeconds")
        since = deleting - timedelta(seconds=grace if isinstance(grace, int) else 0)
        if runtime_state == "running":
            # Still running, but on its way out: a stopping runtime, never "running" (which
            # would lift an Error row to Ready, the shape of Scenario 5's incident).
            runtime_state = "stopping"
    info = RuntimeInfo(
        key=labels.key,
        sandbox_id=labels.sandbox_id,
        generation=labels.generation,
        state=runtime_state,
        exit_code=exit_code,
        runtime_id=str(meta.get("uid", "")),
        identity=labels.identity,
        since=since,
    )
    return PodView(
        info=info,
        name=str(meta.get("name", "")),
        resource_version=str(meta.get("resourceVersion", "")),
        terminating=meta.get("deletionTimestamp") is not None,
        stop_timeout=labels.stop_timeout,
        claim=_claim_of(pod),
        secret=_secret_of(pod),
        pull_failure=pull_failure(pod) if runtime_state == "created" else None,
    )


def _claim_of(pod: Pod) -> str | None:
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        if volume.get("name") == WORKSPACE_VOLUME and volume.get("persistentVolumeClaim"):
            return str(volume["persistentVolumeClaim"].get("claimName", "")) or None
    return None


def _secret_of(pod: Pod) -> str | None:
    for container in (pod.get("spec") or {}).get("containers") or []:
        for env in container.get("env") or []:
            ref = (env.get("valueFrom") or {}).get("secretKeyRef") or {}
            if ref.get("name"):
                return str(ref["name"])
    return None


def sort_views(views: list[PodView]) -> list[PodView]:
    return sorted(views, key=lambda v: (v.info.key, v.info.generation, v.uid))


# --------------------------------------------------------------------------- observations

# What a watch event changes for the fold: the state, its exit code, and whether the stop is
# in progress. Events that change none of these (conditions, IPs) are not reported.
Shape = tuple[RuntimeState, int | None, bool]


def shape(view: PodView) -> Shape:
    return view.info.state, view.info.exit_code, view.terminating


def snapshot(
    view: PodView, *, source: str, actor: str = ACTOR, now: datetime | None = None
) -> RuntimeSnapshot:
    """A snapshot of a Pod. A terminating Pod whose container still runs is "stopping": the
    stop is in progress; it ends in an exit or a removal.

    Ids: ``k8s:<uid>:<resourceVersion>:<state>`` for watch events (a redelivered event repeats
    its id) and ``k8s-list:<uid>:<resourceVersion>:<state>`` for listings (stable while the
    Pod is unchanged, so a relisting repeats it)."""
    info = view.info
    prefix = "k8s" if source == "watch" else "k8s-list"
    return RuntimeSnapshot(
        type="RuntimeSnapshot",
        observation_id=f"{prefix}:{info.runtime_id}:{view.resource_version}:{info.state}",
        key=info.key,
        generation=info.generation,
        # Never past the reader's clock: a node's clock may run ahead of it, and an exit the
        # reconcile loop reports is bounded by its own (reconcile._reported), so a start
        # dated later than the exit of its own generation would lift the Error again.
        occurred_at=_bounded(view.since, now or datetime.now(UTC)),
        actor=actor,
        state=info.state,
        exit_code=info.exit_code,
        runtime_id=info.runtime_id,
        source="watch" if source == "watch" else "list",
    )


def removed(
    key: str,
    generation: int,
    runtime_id: str,
    *,
    resource_version: str | None,
    actor: str = ACTOR,
    now: datetime | None = None,
) -> RuntimeRemoved:
    """A Pod's deletion (from a watch event) or its absence from a relisting (no version)."""
    observation_id = (
        f"k8s:{runtime_id}:{resource_version}:removed"
        if resource_version
        else f"k8s-list:{runtime_id}:removed"
    )
    return RuntimeRemoved(
        type="RuntimeRemoved",
        observation_id=observation_id,
        key=key,
        generation=generation,
        occurred_at=now or datetime.now(UTC),
        actor=actor,
        runtime_id=runtime_id,
        source="watch" if resource_version else "list",
    )


def api_error_message(body: bytes | str | None) -> str:
    """The ``message`` of a Kubernetes Status body, else the body itself (shortened)."""
    if body is None:
        return ""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        status = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])
    return text[:300]
