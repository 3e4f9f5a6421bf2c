"""One ``APIRouter`` per resource; ``services.api.app`` includes them in the order of
``ROUTE_MODULES`` (the order of the paths in docs/openapi.json):

- ``commands``: create, start, stop, restart, delete; a command's status by id.
- ``lifecycle``: hold, release, extend (the time to live); the attention counts.
- ``sandboxes``: the list and one sandbox by name.
- ``history``: every input about a sandbox, in order.
- ``watch``: row changes and every decided event as server-sent events.
- ``audit``: a sandbox's state at a time or input, explain, the hash chains, export.
- ``operations``: health, readiness, metrics.
- ``providers``: providers (create, list, replace credentials, delete), attach and detach.
- ``templates``: templates (create, list, get, update as a new revision, delete).
- ``pools``: warm pools (create, list, get with the status, update, delete).

- ``logs``: a sandbox's output, read from its runtime, never stored.
- ``exec``: a command run in a Ready sandbox (one JSON answer, or server-sent events).
- ``files``: a sandbox's files: upload, download, list, stat, mkdir, remove, move.
"""
