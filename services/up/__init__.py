"""The one-process local default: ``sandstream up`` starts the local stack, then the processor,
executor, watcher, reconciler (``control_plane``) and the HTTP API in one process; ``down``
stops it. Imports the role packages it assembles and services.localstack.

Modules:

- ``control_plane``: the control plane's own roles in one process.
- ``up``: `sandstream up` and `sandstream down`.
"""
