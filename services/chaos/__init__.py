"""The fault-injection checker (``make chaos``, ``python -m services.chaos``): a seeded workload
against separate processor and executor processes on a three-broker cluster and a private
PostgreSQL while it kills, pauses and restarts them; then it checks that nothing was lost,
duplicated or decided differently (docs/reliability.md)."""
