"""The roles as separate long-lived processes: ``sandstream processor``, ``executor``,
``watcher``, ``scheduler`` and ``api``, each with its health endpoint (services/common/health.py)
and the exit codes of services/common/entrypoint.py; ``prepare`` readies the topics, schema and
credentials once before them. ``sandstream up`` stays the one-process local default.

Modules:

- ``api``: `sandstream api`.
- ``driver_roles``: `sandstream executor` and `sandstream watcher`.
- ``leased``: single-active roles.
- ``prepare``: `sandstream prepare`.
- ``processor``: `sandstream processor`.
- ``provider_sync``: `sandstream provider-sync --dir DIR | --kube-selector SEL`.
- ``scheduler``: `sandstream scheduler`.
"""
