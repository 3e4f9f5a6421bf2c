"""What every role shares: settings, metrics, the PostgreSQL pool, migrations, task supervision
and the process entry point. Imports no other package of services/.

Modules:

- ``credentials``: credential values at rest.
- ``database``: the PostgreSQL pool every role opens.
- ``exec_env``: the environment of an exec in a pool member a claim adopted with env or
  providers (the spec's env, the claim's providers' values).
- ``exec_sessions``: what both exec doors hold a command to (deadline, session limits).
- ``entrypoint``: run one long-lived service in the foreground until SIGINT or SIGTERM.
- ``health``: the health endpoint of a role process.
- ``kafka_clients``: the Kafka principal each part of sandstream connects as, and the aiokafka
  options for it.
- ``kafka_requests``: every Kafka request of the process's clients counted by client and type.
- ``lease``: single-active roles.
- ``log_filter``: rate-limited logging of the Kafka client.
- ``log_identity``: which Kafka log the offsets in PostgreSQL belong to.
- ``metrics``: prometheus metrics of the roles (exposed by the API's /metrics under `sandstream up`,
  and by each role process's health endpoint when the roles run as separate processes).
- ``migrations``: the SQL migration runner.
- ``names``: a user's sandbox name resolved at the doors (a claimed name stands for its
  adopted pool member's key).
- ``notify_channels``: LISTEN on a NOTIFY channel under its schema's name (channels are per
  database; each schema has its own).
- ``pool_reset``: a pool connection reset on release only when it may carry session state.
- ``pools``: warm pools in PostgreSQL (the pools, the controller's requested creates, the
  claims served).
- ``providers``: providers in PostgreSQL.
- ``secret_files``: secrets kept in files of their own (mode 0600).
- ``serving``: serving an ASGI app with uvicorn inside the embedding process's event loop (the HTTP
  API, the roles' health endpoints).
- ``settings``: one settings object for ports, paths and credentials.
- ``shared_errors``: one error handed to many waiters, a copy of it for each.
- ``suspend``: whether the configured driver keeps a workspace through a suspend.
- ``templates``: templates in PostgreSQL and their resolution into a create's full spec.
- ``tasks``: named long-running tasks of one process sharing a stop event.
- ``tokens``: bearer tokens with scopes.
- ``usage``: use of the sandboxes through the doors, written coarsely for idle suspend.
"""
