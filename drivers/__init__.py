"""Container backends behind one async protocol (see drivers/protocol.py and docs/drivers.md).

- ``protocol``: the ``Driver`` protocol, its result types, ``DriverError``, the label names.
- ``labels``: the labels stamped on every runtime and workspace, and how they are read back.
- ``launch_precheck``: the launch rules every driver keeps, one pure function.
- ``podman``: ``PodmanDriver``; its parts ``podman_calls`` (blocking calls), ``podman_objects``
  (names, containers read back, errors), ``podman_spec`` (create arguments, confinement),
  ``podman_secrets`` (provider values), ``podman_events`` (observations), ``podman_stream``
  (the event stream's thread), ``podman_execs`` (which exec path, the remembered containers),
  ``podman_exec`` (exec through Podman's API), ``podman_runc`` (exec through runc directly),
  ``podman_exec_end`` (ending an exec early), ``podman_checkpoint`` and ``podman_memory`` (a
  suspend that keeps memory: the checkpoint store, and its calls).
- ``kubernetes``: ``KubernetesDriver``; its parts ``kube_config``, ``kube_api`` (API calls),
  ``kube_waits`` (waiting on one Pod), ``kube_watch`` (what the watch reports), ``kube_objects``
  (the objects, pure), ``kube_exec`` (exec, through the Pod's exec subresource).
- ``logs``, ``podman_logs``, ``kube_logs``: a runtime's log (the LogSource protocol and its
  Podman and Kubernetes readers).
- ``files``, ``files_exec``, ``podman_files``, ``kube_files``, ``tar_stream``: a runtime's files
  (the FileSource protocol, the operations run through exec, the Podman and Kubernetes
  implementations, and tar archives read and written as streams).
- ``fake``, ``fake_shared``: the in-memory fake and its file-shared form.
- ``routing``: two backends at once, by name prefix.
- ``daemon_pool``: the daemon thread pool the Podman driver's calls run in.
"""

from drivers.protocol import (
    Driver,
    DriverError,
    LaunchResult,
    LaunchSpec,
    OpResult,
    RuntimeInfo,
    WatchObservation,
    operation_result,
)

__all__ = [
    "Driver",
    "DriverError",
    "LaunchResult",
    "LaunchSpec",
    "OpResult",
    "RuntimeInfo",
    "WatchObservation",
    "operation_result",
]
