"""OpenShell's gRPC API (``openshell.v1.OpenShell``) served over sandstream: the subset protos
and their generated modules (``proto/``), the pure mapping between the two resource models
(``mapping``), the servicer (``service``), the server (``server``, in ``sandstream up`` or as
its own role) and the runners of OpenShell's conformance suite and CLI (``conformance``).

Modules:

- ``conformance``: OpenShell's conformance suite and CLI against a `sandstream up` of their own.
- ``exec_rpc``: ExecSandbox, with its bounds.
- ``handlers``: OpenShell's method paths (``/openshell.v1.OpenShell/<Method>``) -> the RPCs, with
  raw bytes in.
- ``logs``: GetSandboxLogs, read from the runtime.
- ``mapping``: OpenShell's resource model <-> sandstream's.
- ``provider_door``: what the provider RPCs share (the provider service, its refusals, decoding).
- ``provider_messages``: OpenShell's provider messages <-> sandstream's providers.
- ``providers``: the provider RPCs and their refresh (static credentials only).
- ``proto/``: the subset of OpenShell's protos that sandstream serves (``*.proto``, wire-compatible
  with OpenShell's) and the modules grpcio-tools generates from them (committed).
- ``sandbox_providers``: a sandbox's providers: list, attach, detach.
- ``sandboxes``: the sandbox RPCs.
- ``sdk``: OpenShell's official Python SDK, one virtualenv per released version, made once and
  cached.
- ``server``: the OpenShell-compatible gRPC server (grpcio's asyncio server), in `up` or as its own
  role.
- ``templates``: the 0.1 template RPCs over sandstream's templates.
- ``service``: the door's plumbing: authentication, command ids, submitting commands.
- ``watch``: WatchSandbox: every version of the row (the change feed, and the decided events
  for the versions it moved past), logs, resumable cursors.
- ``wire``: which OpenShell protocol generation sent a request.
"""
