"""The fault-injection checker (``make chaos``, ``python -m services.chaos``): a seeded workload
against separate processor, executor and watcher processes on a three-broker cluster and a
private PostgreSQL (sandboxes on a shared fake backend, a few on real Podman) while it kills,
pauses and restarts them; then it checks that nothing was lost, duplicated or decided
differently and that the backend agrees with the rows (docs/reliability.md).

Modules:

- ``checks``: the checker's end checks, run once every fault is healed and the system has settled.
- ``faults``: the faults the checker injects, one at a time, each healed before the next.
- ``launch``: how the checker starts the roles as processes.
- ``postgres``: a PostgreSQL server of the checker's own (initdb + pg_ctl on its own port and data
  dir), so that restarting it breaks nobody else's tests.
- ``report``: the checker's table.
- ``run``: one checker run.
- ``workload``: the checker's workload.
"""
