"""The fault-injection checker (``make chaos``, ``python -m services.chaos``): a seeded workload
against separate processor, executor and watcher processes on a three-broker cluster and a
private PostgreSQL (sandboxes on a shared fake backend, a few on real Podman) while it kills,
pauses and restarts them; then it checks that nothing was lost, duplicated or decided
differently and that the backend agrees with the rows (docs/reliability.md)."""
