"""The one-process local default: ``sandstream up`` starts the local stack, then the processor,
executor, watcher, reconciler (``control_plane``) and the HTTP API in one process; ``down``
stops it. Imports the role packages it assembles and services.localstack.

Modules:

- ``api_process``: the HTTP API in a child process of its own (``up_api_process``).
- ``control_plane``: the control plane's own roles in one process.
- ``up``: `sandstream up` and `sandstream down`.
"""
